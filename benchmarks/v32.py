"""DeepSeek-V3.2's sparse attention at long context, one layer's decode attention on a GPU.

    python benchmarks/v32.py [--batches 1,8,32] [--contexts 32768,65536,131072] [--topk 2048] [--iters 20]

V3.2's attention shape (128 heads, latent 512 + 64, indexer 64 heads x 128, index_topk 2048, page 64, bf16) over a
random paged cache of `context` tokens per sequence. First the kernel path (kernels/dsa_indexer.py scores, XLA's
top-k, kernels/mla_sparse.py) is checked against the pure-JAX reference (kernels/dsa_reference.py) on a small
case; then each (batch, context) is timed, by wall clock of `--iters` runs of one jitted call after a warm-up:

  indexer      the indexer's scores over every cached key (kernels/dsa_indexer.py)
  top-k        XLA's top-k of those scores
  sparse MLA   attention over the selected keys (kernels/mla_sparse.py)
  DSA total    the three in one program
  dense MLA    the dense decode kernel (kernels/mla_decode.py) over the whole context, what V3 would run

The table prints last (milliseconds per layer).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

H, R, DR, HI, DI, PS = 128, 512, 64, 64, 128, 64


def _inputs(batch: int, context: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    pages_per_seq = -(-context // PS)
    num_pages = batch * pages_per_seq + 1  # page 0 is the null page
    key = jax.random.PRNGKey(seed)
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    cache = jax.random.normal(k1, (1, num_pages, PS, R + DR + DI), jnp.bfloat16)
    q_lat = jax.random.normal(k2, (batch, H, R), jnp.bfloat16)
    q_pe = jax.random.normal(k3, (batch, H, DR), jnp.bfloat16)
    iq = jax.random.normal(k4, (batch, HI, DI), jnp.bfloat16)
    iw = jax.random.normal(k5, (batch, HI), jnp.float32) * HI**-0.5
    table = 1 + rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq).astype(np.int32)
    seq_ids = jnp.arange(batch, dtype=jnp.int32)
    positions = jnp.full((batch,), context - 1, jnp.int32)
    return q_lat, q_pe, iq, iw, cache, seq_ids, positions, jnp.asarray(table)


def _dsa(topk: int, scale: float):
    import jax

    from deepinfer_jax.kernels import dsa_indexer, mla_sparse

    def indexer(iq, iw, cache, sid, pos, pt):
        return dsa_indexer.paged_index_scores(iq, iw, cache, 0, sid, pos, pt, key_start=R + DR)

    def select(scores, pos):
        return dsa_indexer.select_topk(scores, pos, topk)

    def sparse(q_lat, q_pe, cache, sid, pos, pt, idx, valid):
        slots, ok = mla_sparse.selected_slots(idx, valid, sid, pt, PS, mla_sparse.BLOCK_KEYS)
        return mla_sparse.sparse_mla_attention(q_lat, q_pe, cache, 0, slots, ok, scale)

    def total(q_lat, q_pe, iq, iw, cache, sid, pos, pt):
        idx, valid = select(indexer(iq, iw, cache, sid, pos, pt), pos)
        return sparse(q_lat, q_pe, cache, sid, pos, pt, idx, valid)

    return jax.jit(indexer), jax.jit(select), jax.jit(sparse), jax.jit(total)


def _time(fn, *args, iters: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters * 1e3


def check(topk: int, scale: float) -> float:
    """The kernel path against the reference on 4 sequences of 4,096 tokens; returns the max abs error."""
    from deepinfer_jax.kernels.dsa_reference import paged_dsa_attention_reference

    q_lat, q_pe, iq, iw, cache, sid, pos, pt = _inputs(4, 4096, seed=1)
    *_, total = _dsa(topk, scale)
    out = np.asarray(total(q_lat, q_pe, iq, iw, cache, sid, pos, pt), np.float32)
    ref = np.asarray(paged_dsa_attention_reference(q_lat, q_pe, iq, iw, cache, 0, sid, pos, pt, scale, DR, topk),
                     np.float32)
    err = float(np.abs(out - ref).max())
    if not err < 0.05 * max(1.0, float(np.abs(ref).max())):
        raise SystemExit(f"kernel path differs from the reference: max abs error {err}")
    return err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    from deepinfer_jax.kernels.mla_decode import paged_mla_attention

    scale = (128 + DR) ** -0.5
    print(f"check against the reference: max abs error {check(args.topk, scale):.3g}", flush=True)
    import jax

    indexer, select, sparse, total = _dsa(args.topk, scale)
    dense = jax.jit(lambda ql, qp, c, s, p, t: paged_mla_attention(ql, qp, c, 0, s, p, t, scale))
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            q_lat, q_pe, iq, iw, cache, sid, pos, pt = _inputs(b, ctx)
            scores = indexer(iq, iw, cache, sid, pos, pt)
            idx, valid = select(scores, pos)
            row = (b, ctx,
                   _time(indexer, iq, iw, cache, sid, pos, pt, iters=args.iters),
                   _time(select, scores, pos, iters=args.iters),
                   _time(sparse, q_lat, q_pe, cache, sid, pos, pt, idx, valid, iters=args.iters),
                   _time(total, q_lat, q_pe, iq, iw, cache, sid, pos, pt, iters=args.iters),
                   _time(dense, q_lat, q_pe, cache, sid, pos, pt, iters=args.iters))
            rows.append(row)
            print(row, flush=True)
            del cache, scores
    print(f"\n{'batch':>5} {'context':>8} {'indexer':>8} {'top-k':>8} {'sparse':>8} {'DSA':>8} {'dense':>8}  (ms)")
    for b, ctx, *t in rows:
        print(f"{b:>5} {ctx:>8} " + " ".join(f"{x:>8.3f}" for x in t))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
