"""The default model (what `deepinfer serve` runs without --model) lowers for an H200 with the Pallas kernels: every
step program warm-up would compile, traced by the engine itself and lowered for CUDA on this CPU machine. Its
widths are small and not all powers of two (moe_intermediate_size 96, head dims 32 + 16): the Triton lowering
takes only power-of-two tiles, which interpret mode does not check."""

from __future__ import annotations

import pytest

from deepinfer_jax.server.args import DEFAULT_MODEL_DIR


class _LoweredAll(Exception):
    """Raised in place of warm-up's runs: every program has been lowered."""


def test_default_model_step_programs_lower_for_sm90(cuda_lowering, monkeypatch):
    from deepinfer_jax import LLM
    from deepinfer_jax.runner import model_runner, program_cache, warmup

    lowered, failed = [], {}

    def lower(self, pid):
        try:
            traced = self.programs.trace(pid, self.params, self.kv_cache, self._prev_tokens)
            lowered.append(traced.lower(lowering_platforms=("cuda",)))
        except Exception as e:  # noqa: BLE001 - collected and reported below
            failed[str(pid)[:80]] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return None

    def runs(*args, **kwargs):
        raise _LoweredAll

    monkeypatch.setattr(model_runner.ModelRunner, "lower", lower)
    monkeypatch.setattr(program_cache, "compile_program", lambda lowered: (None, False))
    monkeypatch.setattr(warmup, "_runs", runs)
    with pytest.raises(_LoweredAll):
        LLM(DEFAULT_MODEL_DIR, attn_impl="pallas", moe_impl="pallas", max_model_len=256, max_num_seqs=4,
            max_num_batched_tokens=256, token_buckets=(16, 256), progress=False)
    assert not failed, failed
    assert len(lowered) >= 4  # two buckets, each a forward and its samplers
