"""kernels/pdl.py: the early `griddepcontrol.launch_dependents` of our kernels. The decode step's kernels lowered for
sm_90 carry it (with the wait) before their first load where the setting names their family, and not otherwise;
the PTX the `triton` package compiles from that IR keeps the order and assembles for sm_90a; interpret mode runs
the kernels unchanged. (The model's logits with it on: tests/model/test_decode_switches.py.)"""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks import kernel_resources  # noqa: E402
from deepinfer_jax.kernels import decode_matmul, pdl  # noqa: E402

FAMILY = {  # kernel_resources' decode cases -> the family each kernel belongs to
    "attention splits": "attention", "merge + W_UV": "output", "merge + W_UV + o_proj": "output",
    "o_proj (decode_matmul)": "matmul", "absorb + latents (merged q / kv_a read in place)": "absorb",
    "q / kv_a + absorb + latents": "absorb", "partials -> routing": "moe", "routing + MoE single launch [1/2]": "moe",
    "routing + MoE single launch [2/2]": "moe", "partials -> routing -> experts (the MoE launch)": "moe",
}


def _dump(tmp_path, families):
    kernel_resources.dump(str(tmp_path), launch_dependents=families)
    import json

    return [(k["name"], (tmp_path / k["ttir"]).read_text()) for k in json.load(open(tmp_path / "kernels.json"))]


def _signal_lines(ttir: str) -> list[int]:
    return [i for i, line in enumerate(ttir.splitlines()) if "griddepcontrol.launch_dependents" in line]


def test_parse_names_all_and_none():
    assert pdl.parse("all") == tuple(sorted(pdl.FAMILIES))
    assert pdl.parse("none") == pdl.parse(None) == pdl.parse([]) == ()
    assert pdl.parse("moe,attention,moe") == ("attention", "moe")
    with pytest.raises(ValueError, match="unknown kernel families"):
        pdl.parse("moe,lm_head")


def test_decode_kernels_signal_before_their_first_load_where_named(tmp_path):
    on = _dump(tmp_path / "all", "all")
    assert [name for name, _ in on] == list(FAMILY)
    for name, ttir in on:
        lines = ttir.splitlines()
        [at] = _signal_lines(ttir)  # once, at the top level of the kernel
        assert "pure = false" in lines[at] and "griddepcontrol.wait" in lines[at], name
        first_load = next(i for i, line in enumerate(lines) if "tt.load" in line or "tt.atomic_rmw" in line)
        assert at < first_load, name
    off = _dump(tmp_path / "none", ())
    assert all(not _signal_lines(ttir) for _, ttir in off)
    # One family: only its kernels signal (the setting reaches each kernel's trace, and jit retraces under it).
    some = _dump(tmp_path / "attention", ("attention", "matmul"))
    assert [name for name, ttir in some if _signal_lines(ttir)] == ["attention splits", "o_proj (decode_matmul)"]


def test_ptx_keeps_the_signal_before_the_loads_and_assembles(tmp_path):
    """The `triton` package (a dependency of torch in the test environment; XLA bundles its own Triton) compiles
    o_proj's and the attention's IR to PTX: the wait and the signal come before the first global load, and ptxas
    accepts them for sm_90a."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    ptxas = kernel_resources._ptxas(os.path.dirname(triton.__file__))
    kernels = dict(_dump(tmp_path, "all"))
    for name in ("o_proj (decode_matmul)", "attention splits"):
        path = tmp_path / "k.ttir"
        path.write_text(kernels[name])
        ptx = triton.compile(str(path), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1}
                             ).asm["ptx"].splitlines()
        wait, signal = (next(i for i, line in enumerate(ptx) if op in line)
                        for op in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"))
        first_load = next(i for i, line in enumerate(ptx) if re.search(r"\bld\.global", line))
        assert wait < signal < first_load, name
        (tmp_path / "k.ptx").write_text("\n".join(ptx))
        done = subprocess.run([ptxas, "-arch=sm_90a", str(tmp_path / "k.ptx"), "-o", os.devnull], capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr


def test_interpret_mode_runs_the_kernels_unchanged():
    """The signal's value is 0 off the GPU: decode_matmul in interpret mode gives the same bits either way, and
    the jitted wrapper is traced again under the other setting (its jaxpr holds the primitive only there)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 256, 128)), jnp.float32)
    with pdl.launching("all"):
        on = decode_matmul.decode_matmul(x, w, 1, interpret=True)
        traced_on = str(jax.make_jaxpr(lambda a, b: decode_matmul.decode_matmul(a, b, 1, interpret=True))(x, w))
    off = decode_matmul.decode_matmul(x, w, 1, interpret=True)
    traced_off = str(jax.make_jaxpr(lambda a, b: decode_matmul.decode_matmul(a, b, 1, interpret=True))(x, w))
    np.testing.assert_array_equal(np.asarray(on), np.asarray(off))
    np.testing.assert_allclose(np.asarray(off), np.asarray(decode_matmul.decode_matmul_reference(x, w, 1)),
                               rtol=1e-5, atol=1e-4)
    assert "deepinfer_launch_dependents" in traced_on and "deepinfer_launch_dependents" not in traced_off


def test_program_id_outside_the_setting_is_pallas_own():
    def kernel(o_ref):
        o_ref[...] = jnp.full(o_ref.shape, pdl.program_id(0, "moe"), jnp.int32)

    def run():
        return pl.pallas_call(kernel, grid=(4,), out_specs=pl.BlockSpec((8,), lambda i: (i,)),
                              out_shape=jax.ShapeDtypeStruct((32,), jnp.int32), interpret=True)()

    expected = np.repeat(np.arange(4), 8)
    np.testing.assert_array_equal(np.asarray(run()), expected)
    with pdl.launching(["moe"]):
        assert pdl.signals("moe") and not pdl.signals("attention")
        np.testing.assert_array_equal(np.asarray(run()), expected)
    assert not pdl.signals("moe")
