"""The device's memory bandwidth as kernels see it: a read-only reduction, a copy, and a Pallas
(Triton backend) kernel streaming row tiles the way the MoE decode kernels do, over a buffer far larger
than L2. The ceiling the decode step's weight reads are measured against (GPU.md quotes 4.3 TB/s for a
device-to-device copy).

    python benchmarks/hbm_probe.py [--gib 4]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl


def timed(fn, *args, n=20):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def stream_kernel(w_ref, o_ref, *, rows, block_k):
    """Sum a [rows, block_n] column strip of w in [block_k, block_n] tiles (the MoE kernels' pattern)."""
    def body(i, acc):
        return acc + w_ref[pl.ds(i * block_k, block_k), :].astype(jnp.float32).sum(axis=0)

    o_ref[...] = jax.lax.fori_loop(0, rows // block_k, body, jnp.zeros(o_ref.shape, jnp.float32))


def pallas_stream(w, block_k, block_n, num_warps, num_stages):
    from jax.experimental.pallas import triton as plgpu

    R, C = w.shape
    return pl.pallas_call(
        functools.partial(stream_kernel, rows=R, block_k=block_k), grid=(C // block_n,),
        in_specs=[pl.BlockSpec((R, block_n), lambda j: (0, j))],
        out_specs=pl.BlockSpec((block_n,), lambda j: (j,)),
        out_shape=jax.ShapeDtypeStruct((C,), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages))(w)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    args = ap.parse_args()
    n = int(args.gib * 2**30) // 2
    cols = 1 << 16
    w = jax.random.normal(jax.random.key(0), (n // cols, cols), jnp.bfloat16)
    nbytes = w.size * 2
    print(f"device: {jax.devices()[0].device_kind}, buffer {nbytes / 2**30:.1f} GiB")
    t = timed(jax.jit(lambda a: jnp.sum(a, axis=0, dtype=jnp.float32)), w)
    print(f"| XLA column sum (read) | {t * 1e3:.2f} ms | {nbytes / t / 1e12:.2f} TB/s |")
    t = timed(jax.jit(lambda a: a * 2), w)
    print(f"| XLA scale (read + write) | {t * 1e3:.2f} ms | {2 * nbytes / t / 1e12:.2f} TB/s moved |")
    for bk, bn, nw, ns in ((64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3), (64, 128, 4, 4), (128, 256, 8, 3),
                           (32, 256, 4, 4)):
        try:
            t = timed(jax.jit(functools.partial(pallas_stream, block_k=bk, block_n=bn, num_warps=nw, num_stages=ns)), w)
            print(f"| Pallas stream bk{bk} bn{bn} w{nw} s{ns} | {t * 1e3:.2f} ms | {nbytes / t / 1e12:.2f} TB/s |")
        except Exception as e:  # noqa: BLE001
            print(f"| Pallas stream bk{bk} bn{bn} w{nw} s{ns} | failed: {type(e).__name__}: {str(e)[:120]} |")


if __name__ == "__main__":
    main()
