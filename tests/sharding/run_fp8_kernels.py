"""FP8 kernels under mesh layouts on 8 fake CPU devices (Pallas interpret mode); print JSON.

    python tests/sharding/run_fp8_kernels.py MODEL_DIR LAYOUT [LAYOUT ...]

LAYOUT as tests/sharding/run_case.py's ("1x1", "2x1", "1x2ep"). Each runs a short greedy batch with attn_impl and
moe_impl "pallas_interpret" and every FP8 projection size admitted to the FP8 GEMM (quant.FP8_GEMM_MIN_ELEMENTS
0: the tiny model's projections are far below V3's), recording while its step programs are traced: the FP8 GEMM's
calls (the stacked q each reads: a device's slice inside shard_map), the FP8 grouped GEMM's calls, and the q
shapes of every FP8 leaf the reference dequantized. "numerics": one row-parallel and one column-parallel FP8
projection on a 2 x 2 (data, tensor) mesh in W8A8 against the unsharded kernel, relative max difference; "rule":
the o_proj's kernel choice with a minimum size between its per-device slice and the whole weight;
"expert_fallback": what sharded FP8 experts dequantize where the grouped GEMM does not tile them (`expert_fallback`).
Prints one line "RESULT " + JSON {"numerics": {...}, LAYOUT: {...}}.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_case  # noqa: E402  (sets the 8 fake devices before JAX starts)

LENGTHS = (3, 17, 40)


def numerics() -> dict:
    """{name: relative max |sharded - unsharded|} of the FP8 GEMM in W8A8 on a (data 2, tensor 2) mesh."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from deepinfer_jax.models import quant
    from deepinfer_jax.models.decode_kernels import fp8_stackable
    from deepinfer_jax.models.fp8_parallel import fp8_split
    from deepinfer_jax.models.layers import StackedWeight, stacked_matmul
    from deepinfer_jax.models.parallel import MeshRules
    from deepinfer_jax.sharding import ParallelConfig
    from deepinfer_jax.sharding.rules import default_rules

    rng = np.random.default_rng(0)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    mr = MeshRules(mesh, default_rules(ParallelConfig(2, 2, False)))
    out = {}
    for name, shape, n_in, n_out, axes, x_shape in (  # o_proj: K = heads x dv split; gate_up: N split
            ("o_proj", (2, 4, 32, 48), 2, 1, ("layers", "heads", "v_head", "embed"), (12, 4, 32)),
            ("gate_up", (2, 64, 2, 96), 1, 2, ("layers", "embed", None, "mlp"), (12, 64))):
        w = quant.quantize_fp8(rng.standard_normal(shape).astype(np.float32) * 0.1, n_in, n_out, name == "gate_up",
                               (16, 32))
        w = jax.tree.map(jnp.asarray, w)
        split = fp8_split(mr, w, axes, n_in, x_shape[0])
        x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
        ref = stacked_matmul(x, StackedWeight(w, jnp.int32(1), True), n_in)
        got = jax.jit(lambda x, w: stacked_matmul(x, StackedWeight(w, jnp.int32(1), True, split), n_in))(x, w)
        out[name] = {"split": None if split is None else [list(split.w_spec), list(split.reduce)],
                     "error": float(jnp.abs(got - ref).max() / jnp.abs(ref).max())}
        if name == "o_proj":  # the rule on each device's GEMM: a minimum size between its slice and the whole weight
            K, N = 4 * 32, 48
            saved, quant.FP8_GEMM_MIN_ELEMENTS = quant.FP8_GEMM_MIN_ELEMENTS, K * N // 2 + 1
            out["rule"] = {"one_device": fp8_stackable(w, x_shape[0], K, N), "local": list(split.local),
                           "per_device": fp8_stackable(w, *split.local)}
            quant.FP8_GEMM_MIN_ELEMENTS = saved
    return out


def _float_shapes(jaxpr) -> set:
    import jax.extend
    import jax.numpy as jnp

    out = set()
    for eqn in jaxpr.eqns:
        out |= {tuple(v.aval.shape) for v in eqn.outvars
                if hasattr(v.aval, "shape") and jnp.issubdtype(v.aval.dtype, jnp.floating)}
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out |= _float_shapes(sub)
    return out


def expert_fallback() -> dict:
    """FP8 experts stacked [L 2, E 4, ..] split by expert over 2 devices, with the grouped GEMM refusing their
    shapes: {"layer": a device's one layer dequantized, "stack": its every layer dequantized} in the traced step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from deepinfer_jax.kernels import moe_gmm_quant
    from deepinfer_jax.models import quant
    from deepinfer_jax.models.moe import experts_sharded
    from deepinfer_jax.models.parallel import MeshRules

    rng = np.random.default_rng(1)
    L, E, D, I, T = 2, 4, 64, 32, 6
    gu = quant.quantize_fp8(rng.standard_normal((L, E, D, 2, I)).astype(np.float32), 1, 2, True, (16, 32))
    dn = quant.quantize_fp8(rng.standard_normal((L, E, I, D)).astype(np.float32), 1, 1, False, (16, 32))
    ex = {"gate_up": jax.tree.map(jnp.asarray, gu), "down": jax.tree.map(jnp.asarray, dn)}
    x = jnp.ones((T, D), jnp.float32)
    w, idx = jnp.ones((T, 2), jnp.float32), jnp.asarray(rng.integers(0, E, (T, 2)), jnp.int32)
    mr = MeshRules(Mesh(np.array(jax.devices()[:2]), ("d",)), (("expert", ("d",)),))
    supported, moe_gmm_quant.supported = moe_gmm_quant.supported, lambda *a: False
    try:
        shapes = _float_shapes(jax.make_jaxpr(lambda *a: experts_sharded(mr, "pallas_interpret", *a, jnp.int32(1)))(
            ex, x, w, idx).jaxpr)
    finally:
        moe_gmm_quant.supported = supported
    return {"layer": (E // 2, D, 2, I) in shapes, "stack": (L, E // 2, D, 2, I) in shapes}


def main() -> None:
    import numpy as np

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.kernels import fp8_gemm, moe_gmm_quant
    from deepinfer_jax.models import quant

    model_dir, layouts = sys.argv[1], sys.argv[2:]
    quant.FP8_GEMM_MIN_ELEMENTS = 0
    seen: dict = {}

    def spy(key, fn, record):
        def call(*a, **k):
            seen.setdefault(key, []).append(record(*a, **k))
            return fn(*a, **k)
        return call

    fp8_gemm.fp8_matmul = spy("gemm", fp8_gemm.fp8_matmul, lambda x, q, *a, **k: [list(q.shape), k.get("act")])
    moe_gmm_quant.moe_experts_quant = spy("experts", moe_gmm_quant.moe_experts_quant,
                                          lambda *a, **k: [k["fmt_gu"].kind, k["fmt_gu"].act])
    quant.fp8_dequantize = spy("dequantized", quant.fp8_dequantize, lambda w, *a, **k: list(w.q.shape))

    vocab = ModelConfig.from_model_dir(model_dir).vocab_size
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, vocab, n).tolist() for n in LENGTHS]
    out = {"numerics": numerics(), "expert_fallback": expert_fallback()}
    for layout in layouts:
        seen.clear()
        r = run_case.run(model_dir, layout, prompts, moe_impl="pallas_interpret", attn_impl="pallas_interpret")
        out[layout] = {"tokens": r["tokens"], "compiles_after_warmup": r["compiles_after_warmup"],
                       "gemm": sorted(seen.get("gemm", [])), "experts": sorted(seen.get("experts", [])),
                       "dequantized": sorted(seen.get("dequantized", []))}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
