"""INT8 / INT4 experts on the Pallas path go through the quantized grouped GEMMs (kernels/moe_gmm_quant.py):
the step equals the float path on the dequantized weights, and its traced program holds no full-size float
copy of the expert weights (the dequant happens tile by tile inside the kernels)."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import CASES, COMMON
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.kernels import moe_gmm_quant
from deepinfer_jax.models.moe import moe_block
from deepinfer_jax.models.params import init_params
from deepinfer_jax.models.quant import dequantize, is_quantized, quantize_params

LAYER = 1  # of the stacked MoE layers


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_hf_dict({**COMMON, **CASES["v3_grouped_noaux"], "num_hidden_layers": 3})
    params = init_params(cfg, seed=0, dtype=jnp.float32, std=0.05)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((9, cfg.hidden_size)), jnp.float32)
    return cfg, params, x


def _layer(moe: dict, experts_stacked: bool):
    """(this layer's router and shared params, the experts: stacked [L, E, ..] or this layer's [E, ..])."""
    p = {k: v for k, v in moe.items() if k != "experts"}
    p = jax.tree.map(lambda a: a[LAYER], p)
    ex = moe["experts"] if experts_stacked else jax.tree.map(lambda a: a[LAYER], moe["experts"])
    return p, ex


def _float_arrays(jaxpr) -> list[tuple]:
    """Every (shape, dtype) of a floating value produced anywhere in a jaxpr, its sub-jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        out += [(tuple(v.aval.shape), v.aval.dtype) for v in eqn.outvars
                if hasattr(v.aval, "shape") and jnp.issubdtype(v.aval.dtype, jnp.floating)]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _float_arrays(sub)
    return out


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_stream_in_the_kernels(model, method, monkeypatch):
    cfg, params, x = model
    qp = quantize_params(params, method, group_size=16)
    moe = qp["segments"][1]["moe"]
    assert is_quantized(moe["experts"]["gate_up"])
    p, ex = _layer(moe, experts_stacked=True)
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    full = {(E, D, 2, I), (E, I, D), (E, D, 2 * I), (moe["experts"]["down"].q.shape[0], E, I, D)}

    def step(p, ex, x):
        return moe_block(p, cfg, x, "pallas_interpret", experts=ex, layer=jnp.int32(LAYER))

    jaxpr = jax.make_jaxpr(step)(p, ex, x).jaxpr
    assert not [s for s, _ in _float_arrays(jaxpr) if s in full]
    if method == "int4":  # INT8's step against the XLA path: test_paged_forward.py, and the sharded test below
        # the reference: the same layer on its dequantized weights, through XLA's grouped GEMM
        deq = jax.tree.map(lambda w: dequantize(w, jnp.float32) if is_quantized(w) else w, _layer(moe, False)[1],
                           is_leaf=is_quantized)
        ref = moe_block({**p, "experts": deq}, cfg, x, "ragged")
        out = jax.jit(step)(p, ex, x)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5 * float(np.abs(ref).max()) + 1e-6,
                                   rtol=1e-4)
    # the check sees the copies where they exist: shapes the kernels do not tile dequantize the whole layer
    monkeypatch.setattr(moe_gmm_quant, "supported", lambda *a: False)
    jaxpr = jax.make_jaxpr(lambda *a: step(*a))(p, ex, x).jaxpr  # a new function: no cached trace
    assert [s for s, _ in _float_arrays(jaxpr) if s in full]


SHARDED = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from deepinfer_jax.kernels.moe_gmm_quant import WeightFormat, moe_experts_quant
from deepinfer_jax.models.moe import experts_sharded
from deepinfer_jax.models.parallel import MeshRules
from deepinfer_jax.models.quant import quantize
rng = np.random.default_rng(0)
T, D, I, E, k = 6, 64, 64, 4, 2
x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
w = jnp.asarray(rng.random((T, k)), jnp.float32)
mesh = Mesh(np.array(jax.devices()), ("d",))
for bits, split in ((8, "expert"), (4, "moe_mlp")):  # expert parallel; the experts' width split in 16-row groups
    gu = quantize(rng.standard_normal((2, E, D, 2, I)).astype(np.float32) * 0.1, bits, 1, 2, 16)
    dn = quantize(rng.standard_normal((2, E, I, D)).astype(np.float32) * 0.1, bits, 1, 1, 16)
    ex = {"gate_up": jax.tree.map(jnp.asarray, gu), "down": jax.tree.map(jnp.asarray, dn)}
    out = jax.jit(lambda ex, x, w, i: experts_sharded(MeshRules(mesh, ((split, ("d",)),)), "pallas_interpret", ex, x,
                                                      w, i, jnp.int32(1)))(ex, x, w, idx)
    f = lambda a: WeightFormat(f"int{bits}", a.group_size)
    ref = moe_experts_quant(x, gu.q, gu.scale, dn.q, dn.scale, w, idx, jnp.int32(1), fmt_gu=f(gu), fmt_down=f(dn),
                            interpret=True)
    print("ERR", bits, split, float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))))
"""


def test_sharded_quantized_experts_equal_one_device():
    """Two devices (CPU): INT8 experts split over "expert" and INT4 experts split along their width ("moe_mlp")
    through the quantized kernels on each device's slice give the one-device kernels' result."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": repo,
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
    p = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True, env=env, timeout=600)
    errs = [ln.split() for ln in p.stdout.splitlines() if ln.startswith("ERR ")]
    assert p.returncode == 0 and len(errs) == 2, p.stderr[-4000:]
    for _, bits, split, err in errs:
        assert float(err) < 1e-5, (bits, split, err)
