"""DeepSeek-V4's FP4 routed experts in the quantized grouped GEMMs (kernels/moe_gmm_quant.py format "fp4", W4A16)
on the GPU: checked against the reference, then timed beside the bf16 experts (kernels/moe_gmm.py) and FP8 experts
("nk" 128 x 128 blocks, W8A8 and W8A16) at V4-Flash's expert shape: hidden 4096, 256 experts of width 2048, top-6,
swiglu_limit 10 (the bf16 kernels have no limit; the clamp is two elementwise ops in the gate_up epilogue).

    python benchmarks/fp4_experts.py [--tokens 32,128,4096] [--fp4-block-k 128,256] [--cpu-smoke]

FP4 weights are as models/quant_fp4.py's Fp4Weight holds them (the checkpoint's bytes): gate_up [E, 2, I, D / 2]
uint8 packed e2m1 pairs + [E, 2, I, D / 32] e8m0 scale bytes, down [E, D, I / 2] + [E, D, I / 32]. One layer's
experts, uniform random routing. Columns as benchmarks/fp8_kernels.py's: us (GPU time from a profiler trace, or
wall time), TB/s of the weight bytes the step touches (scales included), TFLOP/s (2 x copies x 3 x D x I), and the
ratio to bf16. The checks run first at 16 experts of the same shape and stop the script on a miss.
--fp4-block-k adds FP4 rows ("fp4@128") at other K-step caps than `fp4_block_k`'s (the FP4 kernels' K step is the
largest power of two dividing K up to it: whole 32-column groups). The FP4 rows take the kernels' own `swap_ab`
(`swaps_ab`: the decoded tile as the MMA's first operand at decode sizes); --fp4-swap-ab adds a row of each FP4
kind with it the other way ("fp4~swap").
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

D, I, E, TOPK, LIMIT = 4096, 2048, 256, 6, 10.0
INTERPRET = False  # --cpu-smoke: interpret mode at tiny shapes (the script's own check on a CPU)
KINDS = ["fp4", "fp8/fp8", "fp8/bf16"]  # "fp4@128": FP4 at block_k 128 (--fp4-block-k); "~swap": swap_ab


def _routes(key, T, n_exp):
    import jax

    return jax.vmap(lambda k: jax.random.permutation(k, n_exp)[:TOPK])(jax.random.split(key, T))


def _block_k(kind):
    """The block_k a kind's row asks for ("fp4@128"), or None: the kernels' own."""
    return int(kind.split("~")[0].split("@")[1]) if "@" in kind else None


def _swap(kind, tokens: int = 1):
    """A kind's swap_ab: None (the kernels' own, `swaps_ab`), or its opposite for a "~swap" row at `tokens`."""
    if not kind.endswith("~swap"):
        return None
    from deepinfer_jax.kernels.moe_gmm import tile_config
    from deepinfer_jax.kernels.moe_gmm_quant import WeightFormat, swaps_ab

    return not swaps_ab(tile_config(tokens * TOPK)[0], WeightFormat("fp4", 32, layout="nk"))


def _weights(key, kind, n_exp):
    """(gate_up q, scale, down q, scale, format) of `n_exp` V4-Flash experts in `kind`'s stored layout."""
    import jax
    import jax.numpy as jnp

    from benchmarks.fp8_kernels import _draw, _fp8_weight
    from deepinfer_jax.kernels.moe_gmm_quant import WeightFormat

    k1, k2, k3, k4 = jax.random.split(key, 4)
    if kind.startswith("fp8"):
        gq, gs = _fp8_weight(k1, (n_exp, 2, I, D), (n_exp, 2, I // 128, D // 128))
        dq, ds = _fp8_weight(k2, (n_exp, D, I), (n_exp, D // 128, I // 128))
        return gq, gs, dq, ds, WeightFormat("fp8", 128, 128, kind.split("/")[1], "nk")
    gq = _draw(k1, (n_exp, 2, I, D // 2), jnp.uint8, 0, 256)
    dq = _draw(k2, (n_exp, D, I // 2), jnp.uint8, 0, 256)
    gs = _draw(k3, (n_exp, 2, I, D // 32), jnp.uint8, 118, 123)  # 2 ** -9 .. 2 ** -5
    ds = _draw(k4, (n_exp, D, I // 32), jnp.uint8, 118, 123)
    return gq, gs, dq, ds, WeightFormat("fp4", 32, layout="nk")


def checks(key) -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.fp8_kernels import _check
    from deepinfer_jax.kernels.moe_gmm_quant import moe_experts_quant, moe_experts_quant_reference

    n_exp, T = 16, 8
    x = jax.random.normal(key, (T, D), jnp.bfloat16)
    idx = _routes(key, T, n_exp)
    w = jax.random.uniform(key, (T, TOPK), jnp.float32)
    for kind in KINDS:
        gq, gs, dq, ds, f = _weights(jax.random.fold_in(key, 1), kind, n_exp)
        out = moe_experts_quant(x, gq, gs, dq, ds, w, idx, fmt_gu=f, fmt_down=f, swiglu_limit=LIMIT,
                                block_k=_block_k(kind), swap_ab=_swap(kind, T), interpret=INTERPRET)
        _check(f"moe {kind}", out, moe_experts_quant_reference(x, gq, gs, dq, ds, w, idx, fmt_gu=f, fmt_down=f,
                                                               swiglu_limit=LIMIT))


def table(tokens: list[int]) -> None:
    import functools

    import jax
    import jax.numpy as jnp

    from benchmarks.fp8_kernels import _draw, timed
    from deepinfer_jax.kernels.moe_gmm import moe_experts
    from deepinfer_jax.kernels.moe_gmm_quant import moe_experts_quant

    key = jax.random.key(1)
    checks(key)
    routes = {}
    for T in tokens:
        x = jax.random.normal(jax.random.fold_in(key, T), (T, D), jnp.bfloat16)
        routes[T] = (x, _routes(jax.random.fold_in(key, 10_000 + T), T, E), jax.random.uniform(key, (T, TOPK)))
    times = {}
    for kind in ["bf16", *KINDS]:
        if kind == "bf16":
            args = (_draw(key, (E, D, 2, I), jnp.bfloat16, 0, 0), _draw(jax.random.fold_in(key, 1), (E, I, D),
                                                                         jnp.bfloat16, 0, 0))
            f = jax.jit(functools.partial(moe_experts, interpret=INTERPRET))
            per_expert = 2 * 3 * D * I
        else:
            *args, fmt = _weights(key, kind, E)
            f = jax.jit(lambda x, a, b, c, d, w, i, fmt=fmt, bk=_block_k(kind), kind=kind: moe_experts_quant(
                x, a, b, c, d, w, i, fmt_gu=fmt, fmt_down=fmt, swiglu_limit=LIMIT, block_k=bk,
                swap_ab=_swap(kind, x.shape[0]), interpret=INTERPRET))
            per_expert = sum(a[0].size * a.dtype.itemsize for a in args)
        for T, (x, idx, w) in routes.items():
            try:
                us = timed(f, x, *args, w, idx)
            except jax.errors.JaxRuntimeError as e:  # e.g. a K-step cap whose tiles exceed the shared memory
                print(f"{kind} at {T} tokens: {str(e).splitlines()[0][:120]}")
                us = float("nan")
            times[(kind, T)] = (us, per_expert * len(np.unique(np.asarray(idx))))
        del args
    print(f"\n{'tokens':>6} {'experts':>7} {'kernel':<12} {'us':>8} {'TB/s':>6} {'TFLOP/s':>8} {'vs bf16':>8}")
    for T, (_, idx, _) in routes.items():
        n = len(np.unique(np.asarray(idx)))
        flops = 2 * T * TOPK * 3 * D * I
        for kind in ["bf16", *KINDS]:
            us, nbytes = times[(kind, T)]
            print(f"{T:>6} {n:>7} {kind:<12} {us:>8.1f} {nbytes / us / 1e6:>6.2f} {flops / us / 1e6:>8.1f} "
                  f"{times[('bf16', T)][0] / us:>7.2f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="32,128,4096", help="rows (tokens) a step, comma-separated")
    ap.add_argument("--fp4-block-k", default="",
                    help="extra FP4 rows at these K-step caps (comma-separated powers of two >= 32, e.g. 128,256)")
    ap.add_argument("--fp4-swap-ab", action="store_true",
                    help="also each FP4 row with moe_experts_quant's swap_ab the other way")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes, kernels in interpret mode: checks that the script runs, times nothing useful")
    a = ap.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",")]
    for bk in filter(None, a.fp4_block_k.split(",")):
        if int(bk) < 32 or int(bk) & (int(bk) - 1):
            ap.error(f"--fp4-block-k: {bk} is not a power of two >= 32")
        KINDS.insert(KINDS.index("fp4") + 1, f"fp4@{int(bk)}")
    if a.fp4_swap_ab:
        fp4 = [k for k in KINDS if k.startswith("fp4")]
        KINDS[len(fp4):len(fp4)] = [f"{k}~swap" for k in fp4]
    if a.cpu_smoke:
        global D, I, E, INTERPRET
        D, I, E, INTERPRET = 256, 128, 16, True
        tokens = [5]
    import jax

    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    table(tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
