"""Tuning the paged MLA decode kernel at one step size: every (splits, warps, stages) variant timed as
in a decode step (one call per layer, 26 layers in one jit, so launch overhead is amortised the way a
CUDA graph amortises it), checked against the XLA reference, fastest first.

    python benchmarks/mla_tune.py --batch 32 --context 640
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--splits", default="2,4,8")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,2,3")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.mla_decode import auto_splits, paged_mla_attention
    from deepinfer_jax.kernels.mla_reference import paged_mla_attention_reference

    H, R, dr, ps, L, B, ctx = 16, 512, 64, 64, args.layers, args.batch, args.context
    key = jax.random.key(1)
    pages_per_seq = -(-ctx // ps)
    P = B * pages_per_seq + 1
    kv = jax.random.normal(key, (L, P, ps, R + dr), jnp.bfloat16)
    pt = jnp.asarray((1 + np.random.default_rng(0).permutation(B * pages_per_seq)).reshape(B, pages_per_seq),
                     jnp.int32)
    ql = jax.random.normal(jax.random.fold_in(key, 1), (B, H, R), jnp.bfloat16)
    qp = jax.random.normal(jax.random.fold_in(key, 2), (B, H, dr), jnp.bfloat16)
    sid = jnp.arange(B, dtype=jnp.int32)
    pos = jnp.full((B,), ctx - 1, jnp.int32)
    ref = np.asarray(jax.jit(lambda: paged_mla_attention_reference(ql, qp, kv, L - 1, sid, pos, pt, 0.1147))()
                     .astype(jnp.float32))
    moved = B * ctx * (R + dr) * 2
    rows = []
    for s, w, st in itertools.product(*(map(int, a.split(",")) for a in (args.splits, args.warps, args.stages))):
        fn = jax.jit(lambda ql, qp, kv, s=s, w=w, st=st: tuple(
            paged_mla_attention(ql, qp, kv, layer, sid, pos, pt, 0.1147, num_splits=s, num_warps=w, num_stages=st)
            for layer in range(L)))
        try:
            out = jax.block_until_ready(fn(ql, qp, kv))
            ts = []
            for _ in range(10):
                t = time.perf_counter()
                jax.block_until_ready(fn(ql, qp, kv))
                ts.append(time.perf_counter() - t)
            per = float(np.median(ts)) / L
            err = float(np.abs(np.asarray(out[-1], np.float32) - ref).max())
            rows.append((per, s, w, st, err))
        except Exception as e:  # noqa: BLE001
            print(f"splits {s} warps {w} stages {st}: failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
    print(f"\n## MLA decode, batch {B} at context {ctx}, one call per layer x {L} (auto_splits = {auto_splits(B)})")
    print("| splits | warps | stages | us per layer (incl. split merge) | TB/s of cache read | max err vs ref |")
    print("|---|---|---|---|---|---|")
    for per, s, w, st, err in sorted(rows):
        print(f"| {s} | {w} | {st} | {per * 1e6:.1f} | {moved / per / 1e12:.2f} | {err:.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
