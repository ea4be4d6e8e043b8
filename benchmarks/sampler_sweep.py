"""The decode step's sampler after XLA's lm_head: what each sampling form costs beside the GEMM, V2-Lite's shape
(D 2048, V 102,400), batch 32, random U(+-0.05) weights, bf16. Forms (each `sampling.sample`, its draw swapped):

    gemm      the lm_head alone (the logits' row sums consumed)
    greedy    sample(draw=False): the greedy variant
    hash      sample(full=False) at temperature 1: the Gumbel-max draw over `sampler.noise_bits` (two
              multiply-xorshift rounds an id; the default since session 32)
    threefry  the same with jax.random.gumbel's noise (threefry2x32, ~100 integer operations an id: the draw
              before session 32)
    kernel    the base variant through kernels/lm_head_sample.py logits_sample_stats (one pass over the logits)
              and sampling.sample_from_tile_stats (RunnerConfig.sampler_kernel), at each of --configs
              (block_v x num_warps), its tokens checked against `hash`'s first
    kgreedy   the greedy variant through the same kernel without the noise (every row at temperature 0), its tokens
              checked against `greedy`'s

    python benchmarks/sampler_sweep.py [--batch 32] [--repeat 8] [--iters 20]

Timing as lm_head_sweep.py: `--repeat` copies chained in one jitted program, the device time per copy.
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
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--forms", default="gemm,greedy,hash,threefry,kernel,kgreedy")
    ap.add_argument("--configs", default="512x8,512x4,256x4,1024x8")
    ap.add_argument("--interpret", action="store_true", help="the CPU: the kernel in interpret mode (check only)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.lm_head_sample import logits_sample_stats
    from deepinfer_jax.models.deepseek import lm_head_logits
    from deepinfer_jax.sampling import SamplingTensors, sample, sample_from_tile_stats, sampler

    from benchmarks.tail_timing import chained_us, tail_inputs

    B = args.batch
    h0, w, keys = tail_inputs(B, args.hidden, args.vocab)
    st = dataclasses.replace(SamplingTensors.defaults(B, suppress_len=8), rng_key_data=keys)
    st0 = dataclasses.replace(st, temperature=np.zeros((B,), np.float32))  # every row greedy
    base_noise = sampler.gumbel_noise

    def threefry_noise(k0, k1, col):  # [B, 1] key words -> jax.random.gumbel's noise [B, V] (col: 0 .. V - 1)
        keys = jax.random.wrap_key_data(jnp.concatenate([k0, k1], axis=1), impl="threefry2x32")
        return jax.vmap(lambda k: jax.random.gumbel(k, (col.shape[1],), jnp.float32))(keys)

    def form(name, config=None):
        def run(h, tokens=False):
            logits = lm_head_logits(w, h)
            if name == "gemm":
                return logits.sum(axis=-1)
            if name in ("kernel", "kgreedy"):
                (bv, nw), t = config, st if name == "kernel" else st0
                stats = logits_sample_stats(logits, t.temperature, t.rng_key_data, t.suppress_token_ids,
                                            noise=base_noise if name == "kernel" else None, block_v=bv, num_warps=nw,
                                            interpret=args.interpret)
                out = sample_from_tile_stats(stats, t, max_logprobs=0)
                return out.token_ids if tokens else out.logprob
            sampler.gumbel_noise = threefry_noise if name == "threefry" else base_noise
            try:
                out = sample(logits, st, max_logprobs=0, full=False, draw=name != "greedy")
                return out.token_ids if tokens else out.logprob
            finally:
                sampler.gumbel_noise = base_noise
        return run

    def timed(fn):
        return chained_us(fn, h0, repeat=args.repeat, iters=args.iters)

    rows = []
    for name in args.forms.split(","):
        if name not in ("kernel", "kgreedy"):
            rows.append((name, timed(form(name))))
            continue
        want = np.asarray(jax.jit(lambda h: form("hash" if name == "kernel" else "greedy")(h, tokens=True))(h0))
        for c in args.configs.split(","):
            config = tuple(int(x) for x in c.split("x"))
            got = np.asarray(jax.jit(lambda h: form(name, config)(h, tokens=True))(h0))
            rows.append((f"{name} {c}" + ("" if np.array_equal(got, want) else " (TOKENS DIFFER)"),
                         timed(form(name, config))))
    gemm = dict(rows).get("gemm")
    print(f"\n| form | us a step, B {B} | beyond the GEMM |")
    print("|---|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} | {'' if gemm is None or name == 'gemm' else f'{us - gemm:.1f}'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
