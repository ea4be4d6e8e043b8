"""The decode attention kernel alone, one call between cuProfilerStart and cuProfilerStop, for Nsight Compute:

    export DEEPINFER_XLA_DEFAULTS=0 XLA_PYTHON_CLIENT_PREALLOCATE=false  # else ncu backs up ~100 GB a replay pass
    ncu --profile-from-start off --clock-control none --set full -o REPORT python3 benchmarks/ncu_attention.py

(benchmarks/ncu_table.py prints tables from its CSV: see its docstring for the metrics command.)

V2-Lite's latent cache (16 heads, 512 + 64, pages of 64, bf16), random queries and cache, `--context` keys a
sequence; the kernel's wrapper keywords from `--kernel k=v,...` (e.g. num_warps=8)."""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--kernel", default="")
    ap.add_argument("--output", action="store_true", help="also the output kernel (merge + W_UV) after it")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.kernels import mla_decode, mla_output

    B, H, R, DR, PS, L = args.batch, 16, 512, 64, 64, 27
    pages = -(-(args.context + 1) // PS)
    k = jax.random.split(jax.random.key(0), 4)
    cache = jax.random.normal(k[0], (L, B * pages + 1, PS, R + DR), jnp.bfloat16)
    ql = jax.random.normal(k[1], (B, H, R), jnp.bfloat16)
    qp = jax.random.normal(k[2], (B, H, DR), jnp.bfloat16)
    kv_b = jax.random.normal(k[3], (L, R, H, 256), jnp.bfloat16) * 0.05
    pt = jnp.asarray(1 + np.arange(B * pages).reshape(B, pages), jnp.int32)
    pos = jnp.full((B,), args.context, jnp.int32)
    sid = jnp.arange(B, dtype=jnp.int32)
    kw = {a: int(b) for a, b in (item.split("=") for item in args.kernel.split(","))} if args.kernel else {}

    @jax.jit
    def step(ql, qp, cache, pos):
        o, m, l = mla_decode.paged_mla_attention_splits(ql, qp, cache, 3, sid, pos, pt, 0.1, **kw)
        if args.output:
            return mla_output.merge_value_projection(o, m, l, kv_b, 3, dn=128, dtype=jnp.bfloat16)
        return o

    for _ in range(3):
        jax.block_until_ready(step(ql, qp, cache, pos))
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    jax.block_until_ready(step(ql, qp, cache, pos))
    cuda.cuProfilerStop()
    print("profiled one call", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
