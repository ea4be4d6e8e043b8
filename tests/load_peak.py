"""The device-memory peak of a weight load, as the offload tests measure it."""

from __future__ import annotations


def load_peak(monkeypatch, pending):
    """(pending's params, the most bytes of device-memory arrays the load made that were alive at once), probed
    (jax.live_arrays) around every tensor read, orbax restore and device_put of the load (weights/pending.py
    PendingParams), and after it."""
    import jax
    import orbax.checkpoint as ocp

    from deepinfer_jax.weights import hf_loader

    before = jax.live_arrays()  # held, so no array made by the load reuses one's id
    old = {id(x) for x in before}
    peak = [0]

    def probe():
        peak[0] = max(peak[0], sum(x.nbytes for x in jax.live_arrays()
                                   if id(x) not in old and x.sharding.memory_kind == "device"))

    def spied(fn):
        def run(*args, **kwargs):
            probe()
            out = fn(*args, **kwargs)
            probe()
            return out
        return run

    for owner, name in ((hf_loader, "read_rule_tensor"), (hf_loader, "read_fp8_rule"), (jax, "device_put"),
                        (ocp.PyTreeCheckpointer, "restore")):
        monkeypatch.setattr(owner, name, spied(getattr(owner, name)))
    params = pending.result()
    probe()
    monkeypatch.undo()
    return params, peak[0]
