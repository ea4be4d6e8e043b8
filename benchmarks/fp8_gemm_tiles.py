"""The FP8 dense GEMM's prefill tiles on the GPU: kernels/fp8_gemm.py's planned tiles and a few alternatives,
against bf16 weights through XLA's dot and against dequantize-to-bf16 + XLA's dot (the fallback a size rule
may route to), at DeepSeek-V3's projection shapes (FP8 weights in HF's [out, in], 128 x 128 blocks, W8A8).

    python benchmarks/fp8_gemm_tiles.py [--tokens 128,512,4096] [--shapes o_proj,mlp_gate_up]

"m64split" variants split K over programs above decode sizes too (fp32 partials summed), for the projections whose
output tiles alone give few programs at 128-256 rows (q_a: 1,536 columns, 24 programs of 64 x 128).

Each kernel variant is checked against the reference first (stops on a miss). Columns: us (GPU time from a
profiler trace, else wall time), TFLOP/s, ratio to the bf16 dot.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fp8_kernels import BLOCK, DENSE, _check, _fp8_weight, timed  # noqa: E402

VARIANTS = {"plan": {}, "m64w4s4": dict(tile_m=64, num_warps=4, num_stages=4),
            "m64w4s3": dict(tile_m=64, num_warps=4, num_stages=3), "m128w8s3": dict(tile_m=128, num_warps=8, num_stages=3),
            "m128w8s4": dict(tile_m=128, num_warps=8, num_stages=4), "m128w4s3": dict(tile_m=128, num_warps=4, num_stages=3),
            # K split over programs until about 128 stream the weight (as at decode sizes), fp32 partials summed
            "m64split": dict(tile_m=64, num_warps=4, num_stages=4, split_programs=128),
            "m64split256": dict(tile_m=64, num_warps=4, num_stages=4, split_programs=256)}


def resolve(kw: dict, M: int, K: int, N: int) -> dict:
    """A variant's fp8_matmul arguments at this shape: `split_programs` P becomes the split_k that brings the
    output tiles to P programs (kernels/decode_matmul.py `fewest_chunks`, 128-wide K steps and column tiles)."""
    from deepinfer_jax.kernels.decode_matmul import fewest_chunks

    kw = dict(kw)
    if "split_programs" in kw:
        tiles = (N // BLOCK[1]) * -(-M // kw["tile_m"])
        kw["split_k"] = fewest_chunks(tiles, K // BLOCK[0], kw.pop("split_programs"))
    return kw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,512,4096")
    ap.add_argument("--shapes", default="q_a,q_b,o_proj,mlp_gate_up,mlp_down")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.fp8_gemm import dequant_fp8, fp8_matmul, fp8_matmul_reference

    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    key = jax.random.key(0)
    print(f"{'weight':<12} {'M':>5} {'kernel':<10} {'us':>8} {'TFLOP/s':>8} {'vs bf16':>8}")
    for name in a.shapes.split(","):
        K, N = DENSE[name]
        q, s = _fp8_weight(key, (1, N, K), (1, N // BLOCK[1], K // BLOCK[0]))
        wb = (jax.random.normal(key, (K, N), jnp.float32) * 0.02).astype(jnp.bfloat16)
        for M in (int(t) for t in a.tokens.split(",")):
            x = jax.random.normal(jax.random.fold_in(key, M), (M, K), jnp.bfloat16)
            runs = {"bf16": timed(jax.jit(jnp.dot), x, wb)}
            deq = jax.jit(lambda x, q, s: jnp.dot(x, dequant_fp8(q[0], s[0], (BLOCK[1], BLOCK[0])).astype(
                jnp.bfloat16).T))
            runs["dequant"] = timed(deq, x, q, s)
            ref = fp8_matmul_reference(x, q, s, BLOCK, jnp.int32(0), act_quant=True, layout="nk")
            for v in a.variants.split(","):
                kw = resolve(VARIANTS[v], M, K, N)
                f = jax.jit(lambda x, q, s, kw=kw: fp8_matmul(x, q, s, jnp.int32(0), block=BLOCK, layout="nk", **kw))
                _check(f"{name} M={M} {v}", f(x, q, s), ref)
                runs[v] = timed(f, x, q, s)
            for k, us in runs.items():
                print(f"{name:<12} {M:>5} {k:<10} {us:>8.1f} {2 * M * K * N / us / 1e6:>8.1f} "
                      f"{runs['bf16'] / us:>7.2f}x", flush=True)
        del q, s, wb
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
