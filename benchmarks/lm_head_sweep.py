"""The decode step's tail: the lm_head and the base sampler, as XLA's GEMM + `sampling.sample` against
kernels/lm_head_sample.py + `sampling.sample_from_tile_stats`, over the kernel's tiles. V2-Lite's shape
(D 2048, V 102,400), batch 32, random U(+-0.05) weights, bf16. Each form's tokens are checked against
XLA's (greedy and temperature 1) before it is timed; prints one table.

    python benchmarks/lm_head_sweep.py [--batch 32] [--configs 128x64x4x4,64x128x4x4]

A config is block_v x block_k x num_warps x num_stages. Timing: `--repeat` copies of the computation in one
jitted program (each reading the last one's tokens, so none is hoisted or merged), run `--iters` times
after a warm-up; the table gives the device time per copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=102400)
    ap.add_argument("--configs", default="128x64x4x4,128x128x4x3,64x128x4x4,128x64x8x4,64x64x4x4,32x128x4x4")
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--interpret", action="store_true", help="the CPU: check only, tiny timing")
    args = ap.parse_args(argv)

    import jax

    from deepinfer_jax.kernels.lm_head_sample import lm_head_sample_stats
    from deepinfer_jax.models.deepseek import lm_head_logits
    from deepinfer_jax.sampling import SamplingTensors, gumbel_noise, sample, sample_from_tile_stats

    from benchmarks.tail_timing import chained_us, tail_inputs

    B = args.batch
    h0, w, keys = tail_inputs(B, args.hidden, args.vocab)

    def tensors(temperature):
        return dataclasses.replace(SamplingTensors.defaults(B, suppress_len=8),
                                   temperature=np.full((B,), temperature, np.float32), rng_key_data=keys)

    def xla(h, st):
        return sample(lm_head_logits(w, h), st, max_logprobs=0, full=False)

    def fused(cfg):
        bv, bk, nw, ns = cfg

        def run(h, st):
            stats = lm_head_sample_stats(h, w, st.temperature, st.rng_key_data, st.suppress_token_ids,
                                         noise=gumbel_noise, block_v=bv, block_k=bk, num_warps=nw, num_stages=ns,
                                         interpret=args.interpret)
            return sample_from_tile_stats(stats, st, max_logprobs=0)
        return run

    def timed(fn, st):
        return chained_us(lambda h: fn(h, st).logprob, h0, repeat=args.repeat, iters=args.iters)

    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",") if c]
    st0, st1 = tensors(0.0), tensors(1.0)
    want = {t: np.asarray(jax.jit(xla)(h0, st).token_ids) for t, st in ((0, st0), (1, st1))}
    rows = [("XLA GEMM + sample", timed(xla, st1), "-")]
    for cfg in configs:
        fn = fused(cfg)
        same = all(np.array_equal(np.asarray(jax.jit(fn)(h0, st).token_ids), want[t]) for t, st in ((0, st0), (1, st1)))
        rows.append(("kernel " + "x".join(map(str, cfg)), timed(fn, st1), "yes" if same else "NO"))
    print(f"\n| form (block_v x block_k x warps x stages) | us a step, B {B}, temp 1 | tokens = XLA's (temp 0 and 1) |")
    print("|---|---|---|")
    for name, us, same in rows:
        print(f"| {name} | {us:.1f} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
