"""A long prompt's later chunk against its cached context: one layer's split prefill attention with the context in
the absorbed form (kernels/mla_prefill.py) against the expanded form (kernels/mla_context.py, what runs of
mla_split.CONTEXT_MIN_QUERIES new tokens take), through models/mla_split.py attend_split as a prefill step runs it.

    python benchmarks/prefill_context.py [--preset deepseek-v2-lite] [--cases 1x8192x8192,1x8192x32768,...]

A case BxQxC is B sequences, each with Q new tokens after C cached ones (random latents in a paged cache, random
kv_b_proj at the model's shape, bf16, page 64). Each case first checks that the two forms agree (largest
difference over the largest value of the output), then times each (median wall clock of --iters calls, which at
these sizes is the kernels' time) and prints its attention FLOPs a second: context keys x queries x heads x the
form's FLOPs a key (absorbed 2 x (R + dr + R), expanded 2 x (dn + dr + dv)), the chunk part's causal keys at
the expanded form's cost in both.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _case(text: str) -> tuple[int, int, int]:
    b, q, c = (int(x) for x in text.lower().split("x"))
    return b, q, c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--cases", default="1x8192x8192,1x8192x32768,1x8192x122880,4x2048x16384,16x512x4096",
                    type=lambda s: [_case(x) for x in s.split(",")])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--attn-impl", default="pallas", choices=["pallas", "pallas_interpret"])
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models import mla_split
    from deepinfer_jax.models.cache import StepMetadata

    cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(HERE), "configs", "models", f"{args.preset}.json"))
    H, dn, dr, dv, R = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                        cfg.kv_lora_rank)
    ps, dt = 64, jnp.bfloat16
    print(f"{jax.devices()[0].device_kind}: {args.preset} attention ({H} heads, latent {R} + {dr}, "
          f"expanded {dn} + {dr} / {dv}), page {ps}, bf16")
    rng = np.random.default_rng(0)
    kv_b = jnp.asarray(rng.standard_normal((R, H, dn + dv)) * R ** -0.5, dt)
    p = {"kv_b_proj": kv_b}
    rows, min_expanded = [], mla_split.CONTEXT_MIN_QUERIES
    for B, Q, C in args.cases:
        T = B * Q
        per_seq = -(-(C + Q) // ps)
        num_pages = 1 + B * per_seq
        cache = jnp.asarray(rng.standard_normal((1, num_pages, ps, R + dr)), dt)
        pt = (1 + np.arange(B * per_seq, dtype=np.int32)).reshape(B, per_seq)
        seq = np.repeat(np.arange(B, dtype=np.int32), Q)
        pos = np.tile(np.arange(C, C + Q, dtype=np.int32), B)
        slots = pt[seq, pos // ps] * ps + pos % ps
        meta = StepMetadata(token_ids=jnp.zeros((T,), jnp.int32), positions=jnp.asarray(pos),
                            seq_ids=jnp.asarray(seq), slot_mapping=jnp.asarray(slots), page_table=jnp.asarray(pt),
                            logits_indices=jnp.zeros((B,), jnp.int32), has_context=True)
        latent = cache[0, pt[seq, pos // ps], pos % ps]  # this step's latents, as written to the cache
        q_nope = jnp.asarray(rng.standard_normal((T, H, dn)), dt)
        q_pe = jnp.asarray(rng.standard_normal((T, H, dr)), dt)
        outs, times = {}, {}
        for form, min_queries in (("absorbed", 1 << 30), ("expanded", min_expanded)):
            @jax.jit
            def step(q_nope, q_pe, latent, cache, meta, min_queries=min_queries):
                mla_split.CONTEXT_MIN_QUERIES = min_queries  # read when the step is traced
                plan = mla_split.chunk_split_plan(cfg, meta, args.attn_impl, None, "expanded")
                return mla_split.attend_split(p, cfg, q_nope, q_pe, latent, cache, 0, meta, plan, args.attn_impl)

            outs[form] = step(q_nope, q_pe, latent, cache, meta).block_until_ready()
            ts = []
            for _ in range(args.iters):
                t = time.perf_counter()
                step(q_nope, q_pe, latent, cache, meta).block_until_ready()
                ts.append(time.perf_counter() - t)
            times[form] = float(np.median(ts))
        a, e = (np.asarray(outs[f], np.float32) for f in ("absorbed", "expanded"))
        err = float(np.abs(a - e).max() / max(np.abs(a).max(), 1e-30))
        chunk = B * Q * (Q + 1) / 2 * H * 2 * (dn + dr + dv)
        ctx = B * Q * C * H
        tf_abs = (chunk + ctx * 2 * (2 * R + dr)) / times["absorbed"] / 1e12
        tf_exp = (chunk + ctx * 2 * (dn + dr + dv)) / times["expanded"] / 1e12
        rows.append((f"{B}x{Q}x{C}", times["absorbed"] * 1e3, tf_abs, times["expanded"] * 1e3, tf_exp,
                     times["absorbed"] / times["expanded"], err))
        mla_split.CONTEXT_MIN_QUERIES = min_expanded
        print(f"{rows[-1][0]}: absorbed context {rows[-1][1]:.2f} ms, expanded {rows[-1][3]:.2f} ms, "
              f"difference {err:.1e}", flush=True)
        del cache, outs
    print("\n| sequences x new x cached | absorbed context ms (TFLOP/s) | expanded context ms (TFLOP/s) | speed-up "
          "| difference / max |")
    print("|---|---|---|---|---|")
    for name, ta, fa, te, fe, sp, err in rows:
        print(f"| {name} | {ta:.2f} ({fa:.0f}) | {te:.2f} ({fe:.0f}) | {sp:.2f}x | {err:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
