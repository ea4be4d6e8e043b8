"""Whether Mosaic GPU (Pallas' wgmma + TMA backend) can beat our Pallas-Triton prefill experts: jax's own example
kernels at Protocol A's prefill MoE shape, each timed alone with CUPTI (`mosaic.gpu.profiler.measure`).

    python benchmarks/mgpu_probe.py [--tokens 16384] [--quick]

Rows (bf16, V2-Lite's experts: 64 x [2048, 2 x 1408] gate_up, 64 x [1408, 2048] down, top-6):
  xla dense        one [T*6, K] x [K, N] dot (cuBLAS): the vendor's ceiling for the same FLOPs, no grouping
  mgpu dense       `hopper_matmul_mgpu.matmul` (warp-specialized, 2 compute warpgroups) at the same shape
  mgpu ragged      `ragged_dot_mgpu.ragged_dot` over the T*6 expert-sorted rows (group sizes of a random routing)
  ours grouped     kernels/moe_gmm_mgpu.py over the same rows aligned to 128-row blocks per expert (align_tokens'
                   layout; the TFLOP/s count the T*6 real rows), four of its blocks checked against XLA's product
  ours swiglu      its gate_up form (the SwiGLU in the epilogue, h [rows, 1,408] out), checked the same way
Our kernels' figures at this shape come from `kernels.py --only moe_prefill` (session 29: gate_up 1,904 us = 595
TFLOP/s, down 914 us = 617 TFLOP/s on an H200). A Mosaic grouped GEMM is worth writing only where a row here beats
those by more than the grouping costs.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--quick", action="store_true", help="two configs a kernel")
    ap.add_argument("--forms", default="xla,dense,ragged,grouped", help="which rows (module docstring)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from jax.experimental.mosaic.gpu import profiler

    from deepinfer_jax.kernels.moe_gmm_mgpu import grouped_matmul, grouped_swiglu
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd

    E, k = 64, 6
    M = args.tokens * k
    rng = np.random.default_rng(0)
    sizes = np.bincount(np.argsort(rng.random((args.tokens, E)), axis=1)[:, :k].ravel(), minlength=E)
    group_sizes = jnp.asarray(sizes, jnp.int32)  # [E], sums to M
    print(f"device: {jax.devices()[0].device_kind}; {M} rows over {E} experts ({sizes.min()}-{sizes.max()} each)")
    forms = set(args.forms.split(","))
    blocks = -(-sizes // 128)                                          # 128-row blocks an expert
    block_expert = jnp.asarray(np.repeat(np.arange(E), blocks), jnp.int32)
    R = int(blocks.sum()) * 128                                        # the aligned rows

    def timed(f, *xs):
        try:
            out, ms = profiler.measure(f, iterations=5)(*xs)
        except Exception as e:  # shared memory or register overflows: report, go on
            return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        if ms is None:
            return out, "no kernel timed"
        return out, statistics.median(ms) * 1e3 if isinstance(ms, list) else ms * 1e3

    rows = []
    for name, K, N in (("gate_up", 2048, 2 * 1408), ("down", 1408, 2048)):
        key = jax.random.key(len(name))
        x = jax.random.normal(key, (M, K), jnp.bfloat16)
        w = jax.random.uniform(jax.random.fold_in(key, 1), (E, K, N), jnp.bfloat16, -0.05, 0.05)
        w0 = w[0]  # the dense rows' weight, its own array (no slice inside the timed program)
        flops = 2 * M * K * N

        def add(form, config, us):
            tf = "" if isinstance(us, str) else f"{flops / us / 1e6:.0f}"
            rows.append((name, form, config, us if isinstance(us, str) else f"{us:.0f}", tf))

        if "xla" in forms:
            _, us = timed(jax.jit(lambda x, w: x @ w), x, w0)
            add("xla dense", "-", us)

        dense = list(itertools.product((128,), (128, 64), (4, 8), (hm.MatmulDimension.N, hm.MatmulDimension.M)))
        for tm, tn, width, minor in (dense[:2] if args.quick else dense) if "dense" in forms else ():
            cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=4, grid_tile_width=width,
                                  grid_minor_dim=minor, wg_dimension=hm.MatmulDimension.N)
            _, us = timed(jax.jit(lambda x, w, cfg=cfg: hm.matmul(x, w, None, cfg)), x, w0)
            add("mgpu dense", f"{tm}x{2 * tn} width {width} minor {minor}", us)

        ragged = list(itertools.product(((128, 128), (64, 256), (64, 128)), (4, 6), (1, 4)))
        if "ragged" in forms:
            want = jax.jit(lambda x, w: jax.lax.ragged_dot(x, w, group_sizes))(x, w).astype(jnp.float32)
        for (bm, bn), steps, gbn in (ragged[:2] if args.quick else ragged) if "ragged" in forms else ():
            if N % (bn * gbn):
                continue
            f = jax.jit(functools.partial(rd.ragged_dot, group_sizes=group_sizes, block_m=bm, block_n=bn, block_k=64,
                                          max_concurrent_steps=steps, grid_block_n=gbn))
            out, us = timed(f, x, w)
            if out is not None:
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
                us = us if err < 2e-2 else f"wrong (relative error {err:.3f})"
            add("mgpu ragged", f"{bm}x{bn} steps {steps} gbn {gbn}", us)

        if "grouped" in forms:
            xa = jax.random.normal(jax.random.fold_in(key, 2), (R, K), jnp.bfloat16)
            check = [0, 1, block_expert.shape[0] // 2, block_expert.shape[0] - 1]  # blocks checked
            grouped = list(itertools.product((4, 3), ("m", "n"), (8, 4)))
            kernels = [("ours grouped", grouped_matmul, "128x256")]
            if name == "gate_up":  # the same FLOPs with the SwiGLU in the epilogue: h [R, 1,408]
                kernels.append(("ours swiglu", grouped_swiglu, "128x128 (gate + up)"))
            for (form, kernel, tiles), (steps, minor, width) in itertools.product(
                    kernels, grouped[:2] if args.quick else grouped):
                f = jax.jit(functools.partial(kernel, tile_m=128, tile_n=128, tile_k=64, steps=steps, minor=minor,
                                              width=width))
                out, us = timed(f, xa, w, block_expert)
                if out is not None:
                    err = 0.0
                    for b in check:
                        rows_b = slice(b * 128, (b + 1) * 128)
                        ref = xa[rows_b].astype(jnp.float32) @ w[int(block_expert[b])].astype(jnp.float32)
                        if kernel is grouped_swiglu:
                            ref = jax.nn.silu(ref[:, : N // 2]) * ref[:, N // 2:]
                        got = out[rows_b].astype(jnp.float32)
                        err = max(err, float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref))))
                    us = us if err < 2e-2 else f"wrong (relative error {err:.3f})"
                add(form, f"{tiles} steps {steps} minor {minor} width {width}", us)

    print("\n| matrix | form | config | us | TFLOP/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
