"""FP8 block-scaled and INT8 / INT4 weight-only kernels on the GPU: each checked against its reference, then timed
beside the bf16 kernels at DeepSeek-V3 shapes (hidden 7168; MoE: 256 experts of width 2048, top-8; 128 x 128
FP8 blocks; INT4 in 128-row groups).

    python benchmarks/fp8_kernels.py [--quick] [--only dense|moe] [--tokens 32,128,4096] [--tp N] [--cpu-smoke]

FP8 weights are in the checkpoint's [out, in] orientation (layout "nk"), as models/quant.py's Fp8Weight holds them.
Dense projections (kernels/fp8_gemm.py, layer-stacked weights read in place, as the model holds them): q_a
[7168, 1536], q_b [1536, 24576], kv_b [512, 32768], o_proj [16384, 7168], dense MLP gate_up [7168, 36864] and
down [18432, 7168], with FP8 activations (W8A8, act="fp8") and bf16 ones (W8A16, act="bf16"), against bf16
weights through kernels/decode_matmul.py (decode sizes) or XLA's dot. `--tp N`: each projection at one device's
slice under tensor parallelism N (`TP_SPLIT`: q_b, kv_b and gate_up column-parallel, o_proj and down row-parallel,
q_a whole), the GEMM models/fp8_parallel.py runs per device, to place `quant.FP8_GEMM_MIN_ELEMENTS` for it.

MoE (kernels/moe_gmm_quant.py against kernels/moe_gmm.py's bf16 experts): one layer's routed experts, uniform
random routing, FP8 W8A8 / W8A16, INT8 and INT4 against bf16. Weight bytes are those of the experts a step
touches (printed), scales included.

Columns: us (the kernels' GPU time from a profiler trace, or wall time where no trace is available), TB/s of
weight bytes, TFLOP/s (2 x rows x K x N per GEMM, every token copy counted), and the ratio to the bf16 kernel.
The checks run first at a reduced expert count (16 experts of the same shape) and stop the script on a miss.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

D, I, E, TOPK, BLOCK = 7168, 2048, 256, 8, (128, 128)
DENSE = {"q_a": (7168, 1536), "q_b": (1536, 24576), "kv_b": (512, 32768), "o_proj": (16384, 7168),
         "mlp_gate_up": (7168, 36864), "mlp_down": (18432, 7168)}
TP_SPLIT = {"q_a": None, "q_b": "N", "kv_b": "N", "o_proj": "K", "mlp_gate_up": "N", "mlp_down": "K"}
LAYERS = 2  # stacked layers of each dense weight; layer 1 is read
INTERPRET = False  # --cpu-smoke: the kernels in interpret mode at tiny shapes (the script's own check on a CPU)


def timed(fn, *args) -> float:
    """Microseconds a call: the kernels' GPU time where the profiler trace has them, else the median wall time."""
    from benchmarks.kernels import bench, device_us

    try:
        us = sum(device_us(fn, *args).values())
    except Exception:  # noqa: BLE001  no trace tools on this machine: wall time
        us = 0.0
    return us if us > 0 else bench(fn, *args)[0] * 1e6


def _check(name, out, ref, tol=2e-2):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-6)
    print(f"check {name:<28} max |err| / max |ref| = {err:.2e}")
    if not err < tol:
        raise SystemExit(f"{name}: the kernel does not match its reference ({err:.3g} >= {tol})")


def _fp8_weight(key, shape, scale_shape):
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.fp8_gemm import FP8

    k1, k2 = jax.random.split(key)
    # one jitted draw: the fp32 normals fuse into the cast instead of filling memory first
    q = jax.jit(lambda k: jnp.clip(jax.random.normal(k, shape, jnp.float32) * 100, -448, 448).astype(FP8))(k1)
    s = jax.random.uniform(k2, scale_shape, jnp.float32, 1e-4, 3e-4)
    return q, s


def _draw(key, shape, dtype, lo, hi):
    """Uniform integers in [lo, hi) of `dtype`, or normals x 0.02 for a float dtype, in one jitted draw."""
    import jax
    import jax.numpy as jnp

    if jnp.issubdtype(dtype, jnp.floating):
        return jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(dtype))(key)
    return jax.jit(lambda k: jax.random.randint(k, shape, lo, hi, jnp.int32).astype(dtype))(key)


def _routes(key, T, n_exp):
    """[T, TOPK] distinct uniformly random experts a token."""
    import jax

    return jax.vmap(lambda k: jax.random.permutation(k, n_exp)[:TOPK])(jax.random.split(key, T))


def dense_table(tokens: list[int]) -> None:
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels import decode_matmul as dm
    from deepinfer_jax.kernels.fp8_gemm import fp8_matmul, fp8_matmul_reference, supported

    key = jax.random.key(0)
    layer = jnp.int32(1)
    print(f"\n{'weight':<12} {'M':>5} {'kernel':<10} {'us':>8} {'TB/s':>6} {'TFLOP/s':>8} {'vs bf16':>8}")
    for name, (K, N) in DENSE.items():
        assert supported(K, N, BLOCK), name
        q, s = _fp8_weight(key, (LAYERS, N, K), (LAYERS, N // BLOCK[1], K // BLOCK[0]))  # HF's [out, in]
        wb = _draw(key, (LAYERS, K, N), jnp.bfloat16, 0, 0)
        for M in tokens:
            x = jax.random.normal(jax.random.fold_in(key, M), (M, K), jnp.bfloat16)
            runs = {}
            for act in ("fp8", "bf16"):
                f = jax.jit(lambda x, q, s, act=act: fp8_matmul(x, q, s, layer, block=BLOCK, act=act, layout="nk",
                                                                  interpret=INTERPRET))
                if M == tokens[0]:
                    ref = fp8_matmul_reference(x, q, s, BLOCK, layer, act_quant=act == "fp8", layout="nk")
                    _check(f"{name} act={act}", f(x, q, s), ref)
                runs[f"fp8/{act}"] = (timed(f, x, q, s), K * N + s[0].size * 4)
            if M <= dm.MAX_TOKENS and dm.supported(M, K, N):
                fb = jax.jit(lambda x, w: dm.decode_matmul(x, w, layer, interpret=INTERPRET).astype(jnp.bfloat16))
            else:
                fb = jax.jit(lambda x, w: jnp.dot(x, w[1]))
            runs["bf16"] = (timed(fb, x, wb), 2 * K * N)
            base = runs["bf16"][0]
            for kname, (us, nbytes) in runs.items():
                print(f"{name:<12} {M:>5} {kname:<10} {us:>8.1f} {nbytes / us / 1e6:>6.2f} "
                      f"{2 * M * K * N / us / 1e6:>8.1f} {base / us:>7.2f}x")
        del q, s, wb


def _moe_weights(key, kind, n_exp):
    """(gate_up q, scale, down q, scale, format) of `n_exp` V3 experts in `kind`'s layout, random values."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.moe_gmm_quant import WeightFormat

    k1, k2, k3, k4 = jax.random.split(key, 4)
    if kind.startswith("fp8"):  # HF's orientation, as models/quant.py's Fp8Weight holds it
        gq, gs = _fp8_weight(k1, (n_exp, 2, I, D), (n_exp, 2, I // 128, D // 128))
        dq, ds = _fp8_weight(k2, (n_exp, D, I), (n_exp, D // 128, I // 128))
        return gq, gs, dq, ds, WeightFormat("fp8", 128, 128, kind.split("/")[1], "nk")
    if kind == "int8":
        gq = _draw(k1, (n_exp, D, 2, I), jnp.int8, -127, 128)
        dq = _draw(k2, (n_exp, I, D), jnp.int8, -127, 128)
        gs = jax.random.uniform(k3, (n_exp, 1, 2, I), jnp.float32, 1e-4, 3e-4)
        ds = jax.random.uniform(k4, (n_exp, 1, D), jnp.float32, 1e-4, 3e-4)
        return gq, gs, dq, ds, WeightFormat("int8")
    gq = _draw(k1, (n_exp, D // 2, 2, I), jnp.uint8, 0, 256)
    dq = _draw(k2, (n_exp, I // 2, D), jnp.uint8, 0, 256)
    gs = jax.random.uniform(k3, (n_exp, D // 128, 2, I), jnp.float32, 2e-3, 6e-3)
    ds = jax.random.uniform(k4, (n_exp, I // 128, D), jnp.float32, 2e-3, 6e-3)
    return gq, gs, dq, ds, WeightFormat("int4", 128)


KINDS = ("fp8/fp8", "fp8/bf16", "int8", "int4")


def moe_checks(key) -> None:
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.moe_gmm_quant import moe_experts_quant, moe_experts_quant_reference

    n_exp, T = 16, 8
    x = jax.random.normal(key, (T, D), jnp.bfloat16)
    idx = _routes(key, T, n_exp)
    w = jax.random.uniform(key, (T, TOPK), jnp.float32)
    for kind in KINDS:
        gq, gs, dq, ds, f = _moe_weights(jax.random.fold_in(key, 1), kind, n_exp)
        out = moe_experts_quant(x, gq, gs, dq, ds, w, idx, fmt_gu=f, fmt_down=f, interpret=INTERPRET)
        _check(f"moe {kind}", out, moe_experts_quant_reference(x, gq, gs, dq, ds, w, idx, fmt_gu=f, fmt_down=f))


def moe_table(tokens: list[int], variants: list[tuple[int, int, int, int]] = ()) -> None:
    """The MoE table; `variants` (block_k, num_stages, num_warps, swap_ab; 0 = the default): extra FP8 W8A8 rows
    with those tiles (`--fp8-moe-tiles`)."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.moe_gmm import moe_experts
    from deepinfer_jax.kernels.moe_gmm_quant import moe_experts_quant

    key = jax.random.key(1)
    moe_checks(key)
    routes = {}
    for T in tokens:
        x = jax.random.normal(jax.random.fold_in(key, T), (T, D), jnp.bfloat16)
        routes[T] = (x, _routes(jax.random.fold_in(key, 10_000 + T), T, E), jax.random.uniform(key, (T, TOPK)))
    times = {}
    names = {f"fp8 k{bk or '-'}s{st or '-'}w{wp or '-'}{'x' if sw else ''}": (bk, st, wp, sw)
             for bk, st, wp, sw in variants}
    kinds = ("bf16",) + KINDS + tuple(names)
    variant_weights = None  # the FP8 W8A8 experts, drawn once for every variant row
    for kind in kinds:
        if kind == "bf16":
            wgu = _draw(key, (E, D, 2, I), jnp.bfloat16, 0, 0)
            wd = _draw(jax.random.fold_in(key, 1), (E, I, D), jnp.bfloat16, 0, 0)
            f = jax.jit(functools.partial(moe_experts, interpret=INTERPRET))
            args, per_expert = (wgu, wd), 2 * 3 * D * I
        else:
            tiles = {}
            if kind in names:
                variant_weights = variant_weights or _moe_weights(key, "fp8/fp8", E)
                gq, gs, dq, ds, fmt = variant_weights
                tiles = {k: v or None for k, v in zip(("block_k", "num_stages", "num_warps", "swap_ab"), names[kind])}
            else:
                gq, gs, dq, ds, fmt = _moe_weights(key, kind, E)
            f = jax.jit(lambda x, a, b, c, d, w, i, fmt=fmt, tiles=tiles: moe_experts_quant(
                x, a, b, c, d, w, i, fmt_gu=fmt, fmt_down=fmt, interpret=INTERPRET, **tiles))
            args = (gq, gs, dq, ds)
            per_expert = sum(a[0].size * a.dtype.itemsize for a in args)
        for T, (x, idx, w) in routes.items():
            us = timed(f, x, *args, w, idx)
            times[(kind, T)] = (us, per_expert * len(np.unique(np.asarray(idx))))
        del args
        if kind == "bf16":
            del wgu, wd
        else:
            del gq, gs, dq, ds
    print(f"\n{'tokens':>6} {'experts':>7} {'kernel':<13} {'us':>8} {'TB/s':>6} {'TFLOP/s':>8} {'vs bf16':>8}")
    for T, (_, idx, _) in routes.items():
        n = len(np.unique(np.asarray(idx)))
        flops = 2 * T * TOPK * 3 * D * I
        for kind in kinds:
            us, nbytes = times[(kind, T)]
            print(f"{T:>6} {n:>7} {kind:<13} {us:>8.1f} {nbytes / us / 1e6:>6.2f} {flops / us / 1e6:>8.1f} "
                  f"{times[('bf16', T)][0] / us:>7.2f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("dense", "moe"))
    ap.add_argument("--tokens", default="32,128,4096", help="rows (tokens) a step, comma-separated")
    ap.add_argument("--quick", action="store_true", help="decode sizes only (32 tokens)")
    ap.add_argument("--tp", type=int, default=1, help="dense projections at one device's slice under TP of this size")
    ap.add_argument("--fp8-moe-tiles", default="",
                    help="extra FP8 W8A8 MoE rows with other tiles: comma-separated "
                         "block_k:num_stages[:num_warps[:swap_ab]] (0 keeps the default; swap_ab 1: the weight tile as "
                         "the MMA's first operand), e.g. 128:3,128:4,0:0:0:1")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes, kernels in interpret mode: checks that the script runs, times nothing useful")
    a = ap.parse_args(argv)
    tokens = [32] if a.quick else [int(t) for t in a.tokens.split(",")]
    global D, I, E, DENSE, INTERPRET
    if a.cpu_smoke:
        D, I, E, INTERPRET = 256, 128, 16, True
        DENSE = {"q_b": (256, 512), "o_proj": (512, 256)}
        tokens = [5, 70]
    if a.tp > 1:
        DENSE = {name: (K // a.tp if TP_SPLIT[name] == "K" else K, N // a.tp if TP_SPLIT[name] == "N" else N)
                 for name, (K, N) in DENSE.items()}
        print(f"dense projections at one device's slice under TP {a.tp}: {DENSE}")
    import jax

    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    if a.only in (None, "dense"):
        dense_table(tokens)
    if a.only in (None, "moe"):
        variants = [tuple(int(v) for v in (t.split(":") + ["0"] * 3)[:4]) for t in a.fp8_moe_tiles.split(",") if t]
        moe_table(tokens, variants)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
