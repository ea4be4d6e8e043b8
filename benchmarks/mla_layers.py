"""Decode attention as the step runs it: one paged MLA attention call per layer, 27 layers in one jitted
program, so per-call launch overheads do not hide the kernel (a single timed call is mostly launch).
Sweeps the kernel's launch parameters at one batch / context and prints us per layer against the
cache-read floor.

    python benchmarks/mla_layers.py [--batch 32] [--context 640]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.kernels.mla_decode import paged_mla_attention
from deepinfer_jax.kernels.mla_reference import paged_mla_attention_reference

HBM = 4.3e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--configs", default="4:8:2:16,4:4:2:16,4:8:1:16,2:8:2:16,8:8:2:16,8:4:2:16,4:8:2:8,16:4:2:16",
                    help="splits:warps:stages:block_h, comma-separated")
    args = ap.parse_args()
    B, ctx, L = args.batch, args.context, args.layers
    H, R, dr, ps = 16, 512, 64, 64
    pages = -(-(ctx + 1) // ps)
    P = B * pages + 1
    key = jax.random.key(0)
    kv = jax.random.normal(key, (L, P, ps, R + dr), jnp.bfloat16)
    pt = jnp.asarray((1 + np.random.default_rng(0).permutation(B * pages)).reshape(B, pages).astype(np.int32))
    ql = jax.random.normal(jax.random.fold_in(key, 1), (B, H, R), jnp.bfloat16)
    qp = jax.random.normal(jax.random.fold_in(key, 2), (B, H, dr), jnp.bfloat16)
    sid = jnp.arange(B, dtype=jnp.int32)
    pos = jnp.full((B,), ctx, jnp.int32)
    floor_us = B * (ctx + 1) * (R + dr) * 2 / HBM * 1e6
    ref = np.asarray(paged_mla_attention_reference(ql, qp, kv, 3, sid, pos, pt, 0.1147).astype(jnp.float32))
    print(f"batch {B}, context {ctx + 1}, {L} layers; cache-read floor {floor_us:.1f} us per layer")
    print("| splits | warps | stages | block_h | us / layer | of floor | max err (layer 3) |")
    print("|---|---|---|---|---|---|---|")
    for c in args.configs.split(","):
        s, w, st, bh = (int(v) for v in c.split(":"))
        attn = functools.partial(paged_mla_attention, scale=0.1147, num_splits=s, num_warps=w, num_stages=st,
                                 block_h=bh)

        @jax.jit
        def all_layers(ql, qp, kv):
            outs, q = [], ql
            for layer in range(L):  # each layer's query depends on the last output, as in the model
                o = attn(q, qp, kv, layer, sid, pos, pt)
                outs.append(o)
                q = (ql + o * 1e-3).astype(ql.dtype)
            return outs

        try:
            outs = jax.block_until_ready(all_layers(ql, qp, kv))
            one = np.asarray(attn(ql, qp, kv, 3, sid, pos, pt).astype(jnp.float32))
            ts = []
            for _ in range(20):
                t = time.perf_counter()
                jax.block_until_ready(all_layers(ql, qp, kv))
                ts.append(time.perf_counter() - t)
            us = float(np.median(ts)) / L * 1e6
            print(f"| {s} | {w} | {st} | {bh} | {us:.1f} | {us / floor_us:.2f}x | {np.abs(one - ref).max():.3g} |",
                  flush=True)
            del outs
        except Exception as e:  # noqa: BLE001
            print(f"| {s} | {w} | {st} | {bh} | failed: {type(e).__name__}: {str(e)[:150]} |", flush=True)


if __name__ == "__main__":
    main()
