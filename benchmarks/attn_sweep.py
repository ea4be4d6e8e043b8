"""The decode attention kernel's device time inside one program, per variant and context (profiler trace).

    python benchmarks/attn_sweep.py [--batch 32] [--contexts 64,256,640] [--variants base,w8,...]

One jitted program calls `mla_decode.paged_mla_attention_splits` once per layer (27, V2-Lite's latent
cache: 16 heads, 512 + 64, page 64, bf16) on random queries and a random cache, as a decode step does;
a profiler trace of a few runs gives the kernel's device time per call, without launch overhead (an
isolated call's wall clock is all launch at these sizes). Each variant is also checked against the
default kernel's output. The table prints last.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

VARIANTS = {  # name -> paged_mla_attention_splits keyword arguments
    "base": {},
    "w8": {"num_warps": 8},
    "prefetch": {"prefetch_ids": True},
    "prefetch_s3": {"prefetch_ids": True, "num_stages": 3},
    "pps2": {"pages_per_step": 2},
    "bk32": {"block_keys": 32},
    "bk32_s4": {"block_keys": 32, "num_stages": 4},
    "bk32_pf_s3": {"block_keys": 32, "prefetch_ids": True, "num_stages": 3},
    "bk32_pf_s4": {"block_keys": 32, "prefetch_ids": True, "num_stages": 4},
    "bk32_pf_s3_w8": {"block_keys": 32, "prefetch_ids": True, "num_stages": 3, "num_warps": 8},
    "bk32_pf_s3_x2": {"block_keys": 32, "prefetch_ids": True, "num_stages": 3, "splits_x": 2},
    "bk16_pf_s3": {"block_keys": 16, "prefetch_ids": True, "num_stages": 3},
    "bk16_pf_s4": {"block_keys": 16, "prefetch_ids": True, "num_stages": 4},
    "bk16_pf_s6": {"block_keys": 16, "prefetch_ids": True, "num_stages": 6},
    "splits_x2": {"splits_x": 2},
    "c1": {"qk_chunks": 1},
    "c2": {"qk_chunks": 2},
    "c4": {"qk_chunks": 4},
    "c8": {"qk_chunks": 8},
    "c4_w8": {"qk_chunks": 4, "num_warps": 8},
    "c4_s2": {"qk_chunks": 4, "num_stages": 2},
    # whole 64-key pages a loop step with the page id prefetch (half the steps, so half the cross-warp softmax
    # reductions and barriers a key, for a kernel that ncu finds bound by its warps' issue latency)
    "bk64": {"block_keys": 64},
    "bk64_s2": {"block_keys": 64, "num_stages": 2},
    "bk64_w8": {"block_keys": 64, "num_warps": 8},
    "bk64_c1": {"block_keys": 64, "qk_chunks": 1},
    # fixed context splits for one or two long sequences (16 splits: 16 or 32 programs stream the whole cache); the
    # kernel's time only: the merge reads splits x 16 x 512 fp32 a token
    "s32": {"splits": 32},
    "s64": {"splits": 64},
    "s128": {"splits": 128},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="32x64,32x256,32x640",
                    help="BATCHxCONTEXT,...: the decode steps to time (splits: mla_decode.auto_splits(BATCH))")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--layers", type=int, default=27)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from benchmarks.trace_tools import gpu_kernels
    from deepinfer_jax.kernels import mla_decode

    H, R, dr, ps, L = 16, 512, 64, 64, args.layers
    rows = []
    for case in args.cases.split(","):
        B, ctx = (int(v) for v in case.split("x"))
        width = -(-ctx // ps)
        P = B * width + 1
        kv = jax.random.normal(jax.random.key(0), (L, P, ps, R + dr), jnp.bfloat16)
        ql = jax.random.normal(jax.random.key(1), (L, B, H, R), jnp.bfloat16)
        qp = jax.random.normal(jax.random.key(2), (L, B, H, dr), jnp.bfloat16)
        perm = np.random.default_rng(0).permutation(np.arange(1, P))[: B * width]
        pt = jnp.asarray(perm.reshape(B, width), jnp.int32)
        sid = jnp.arange(B, dtype=jnp.int32)
        pos = jnp.full((B,), ctx - 1, jnp.int32)
        ref = None
        for name in args.variants.split(","):
            kw = dict(VARIANTS[name], interpret=jax.default_backend() == "cpu")  # CPU: a smoke test
            kw["num_splits"] = kw.pop("splits", None) or mla_decode.auto_splits(B) * kw.pop("splits_x", 1)

            @jax.jit
            def step(ql, qp, kv, pos, kw=kw, pt=pt, sid=sid):
                outs = []
                for layer in range(L):
                    o, m, l = mla_decode.paged_mla_attention_splits(ql[layer], qp[layer], kv, layer, sid, pos, pt, 0.1,
                                                                    **kw)
                    outs.append(mla_decode.merge_splits(o, m, l))
                return jnp.stack(outs)

            try:
                out = jax.block_until_ready(step(ql, qp, kv, pos))
            except Exception as e:  # a variant that does not compile (shared memory) is a row, not a failure
                rows.append((case, name, float("nan"), float("nan"), f"{type(e).__name__}: {str(e)[:80]}"))
                continue
            if ref is None:
                ref = out
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            d = tempfile.mkdtemp()
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(3):
                    jax.block_until_ready(step(ql, qp, kv, pos))
            durs = defaultdict(list)
            for e in gpu_kernels(d) or []:
                if e["name"].startswith("_kernel"):
                    durs[e["name"]].append(e.get("dur", 0.0))
            us = float(np.median([x for v in durs.values() for x in v])) if durs else float("nan")
            cache_mb = B * ctx * (R + dr) * 2 / 1e6
            rows.append((case, name, us, cache_mb / us if us == us else float("nan"),
                         f"splits {kw['num_splits']}, max diff {err:.2e}"))
            print(rows[-1], flush=True)
    print("\n| batch x context | variant | us / layer | TB/s of cache | check |  (16 heads, page 64, bf16)")
    print("|---|---|---|---|---|")
    for case, name, us, tbs, note in rows:
        print(f"| {case} | {name} | {us:.1f} | {tbs:.2f} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
