"""A prefill step's write of its keys and values into the paged cache on the GPU, each way XLA can be asked for it:
GPU time a layer (profiler trace; wall time on a CPU) and the bytes written a second.

    python benchmarks/kv_write.py [--tokens 16384] [--row 2,8,128] [--page-size 64]

The cache is [L, P, page, *row] (the dense family's row: k and v of each KV head, [2, KVH, hd]; DeepSeek's:
the 576-wide latent), the step's T tokens land on shuffled pages as a prefill's do, padding tokens on the null
page. Ways:
- `pages`: `cache.at[layer, page, offset].set(kv)`, two scatter indices a token;
- `pages unique`: the same with `unique_indices=True` (the null page's duplicates are padding, never read):
  models/cache.py `write_slots`, which both families' cache writes use;
- `slots`: the cache seen as one row a slot over every layer, `.at[layer * P * page + slot].set(kv)`, one index
  a token;
- `slots unique`: the same, unique.
Each way's result is checked against `pages` first.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rows", default="2,8,128;576", help="row shapes to try, ';'-separated")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from benchmarks.fp8_kernels import timed

    T, ps, L = a.tokens, a.page_size, a.layers
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    print("| row | tokens | way | us a layer | written GB/s |")
    print("|---|---|---|---|---|")
    for row in ([int(v) for v in r.split(",")] for r in a.rows.split(";")):
        real = T - T // 16  # the step's last sixteenth is padding
        P = 1 + -(-real // ps) + 8
        pages = 1 + np.random.default_rng(0).permutation(P - 1)[: -(-real // ps)]
        slot = np.zeros(T, np.int32) + np.arange(T) % ps  # padding: the null page (0)
        slot[:real] = pages[np.arange(real) // ps] * ps + np.arange(real) % ps
        slot = jnp.asarray(slot)
        kv = jax.random.normal(jax.random.key(1), (T, *row), jnp.bfloat16)
        width = int(np.prod(row))

        def pages_way(cache, layer, kv, slot, unique=False):
            return cache.at[layer, slot // ps, slot % ps].set(kv, unique_indices=unique)

        def slots_way(cache, layer, kv, slot, unique=False):
            flat = cache.reshape(-1, width)
            idx = layer * (P * ps) + slot
            return flat.at[idx].set(kv.reshape(T, width), unique_indices=unique).reshape(cache.shape)

        ways = {"pages": pages_way, "pages unique": lambda *x: pages_way(*x, unique=True), "slots": slots_way,
                "slots unique": lambda *x: slots_way(*x, unique=True)}
        want = None
        for name, fn in ways.items():
            f = jax.jit(fn, donate_argnums=0)
            state = {"cache": jnp.zeros((L, P, ps, *row), jnp.bfloat16)}

            def step(f=f, state=state):
                state["cache"] = f(state["cache"], jnp.int32(L - 1), kv, slot)
                return state["cache"]

            got = np.asarray(step()[L - 1, 1:].astype(jnp.float32))  # the null page's contents are not compared
            if want is None:
                want = got
            elif not np.array_equal(got, want):
                raise SystemExit(f"{name}: the cache differs from `pages`'")
            us = timed(step)
            print(f"| {row} | {T} | {name} | {us:.1f} | {T * width * 2 / us / 1e3:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
