"""The decode MoE with its two expert kernels in one launch against two launches, on the GPU: the same
outputs bit for bit (bf16 and fp32, V2-Lite shapes, random routing of realistic spread), and the time of
a few layers' MoE in one program (wall clock over repeated calls, per layer).

    python3 benchmarks/moe_launch_check.py [--batch 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from deepinfer_jax.kernels import moe_route  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    L, E, D, I, S, k, T = args.layers, 64, 2048, 1408, 2, 6, args.batch
    key = jax.random.split(jax.random.PRNGKey(0), 6)
    u = lambda kk, shape, dt: jax.random.uniform(kk, shape, dt, -0.05, 0.05)  # noqa: E731
    rows = []
    for dt in (jnp.bfloat16, jnp.float32):
        Lc = L if dt == jnp.bfloat16 else 2
        wgu, wd = u(key[0], (Lc, E, D, 2, I), dt), u(key[1], (Lc, E, I, D), dt)
        sgu, sd = u(key[2], (Lc, D, 2, S * I), dt), u(key[3], (Lc, S * I, D), dt)
        x = jax.random.normal(key[4], (T, D), dt)
        logits = jax.random.normal(key[5], (Lc, T, E), jnp.float32) * 2.0

        def make(single):
            def run(x, logits):
                outs = []
                for layer in range(Lc):
                    y, _ = moe_route.moe_fused_decode(x, logits[layer], None, wgu, wd, layer, sgu, sd, k=k,
                                                      single_launch=single)
                    outs.append(y)
                    x = (x + y).astype(dt)
                return jnp.stack(outs)
            return jax.jit(run)

        got = {}
        for single in (False, True):
            fn = make(single)
            out = fn(x, logits).block_until_ready()
            got[single] = np.asarray(out.astype(jnp.float32))
            if dt == jnp.bfloat16:
                for _ in range(3):
                    fn(x, logits).block_until_ready()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    out = fn(x, logits)
                out.block_until_ready()
                us = (time.perf_counter() - t0) / args.iters / Lc * 1e6
                rows.append(f"| {'one launch' if single else 'two launches'} | bf16 | {us:.1f} us a layer |")
                print(rows[-1], flush=True)
        same = np.array_equal(got[False], got[True])
        diff = float(np.abs(got[False] - got[True]).max())
        rows.append(f"| equal | {jnp.dtype(dt).name} | {same} (max diff {diff:.3g}) |")
        print(rows[-1], flush=True)
    print(f"MoE decode, batch {T}, {L} layers")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
