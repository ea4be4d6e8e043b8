"""kernels/decode_matmul.py's launch on the GPU at the decode projections' shapes: the planned launch and
alternatives (tiles, K chunks, warps, pipeline stages) against cuBLAS, as weight bytes streamed per second.

    python benchmarks/decode_matmul_tiles.py [--tokens 32] [--models llama-3.1-8b,qwen2.5-7b,deepseek-v2-lite]
                                             [--plan-only]

A decode projection is a weight stream: T rows against a [K, N] weight read once. Each shape's weight is
stacked over enough layers to be several times the L2 cache, and one timed call runs every layer once (static
layer ids), so each layer streams from HBM as in a decode step. Times are GPU time from a profiler trace (the
kernel and the sum of its split-K partials), per layer. Rows:
- `plan`: the launch `decode_matmul.plan` picks; `bnB bkK pP wW sS`: block_n, block_k, about P programs (the K
  chunks `fewest_chunks` gives for that many), warps, stages;
- `cublas unstacked`: XLA's dot on each layer's own array (no slice to copy: the floor of the GEMM library);
- `xla stacked`: XLA's dot on static slices of the stacked array (what straight-line layers would run).
Each kernel launch is checked against the reference first.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fp8_kernels import _check, timed  # noqa: E402

# (name, K, N) of each model's decode projections as kernels/decode_matmul.py sees them: the dense family's
# q_proj, kv_proj, o_proj, gate_up, down (models/dense.py STACKABLE); DeepSeek's o_proj and dense MLP
# (models/decode_kernels.py STACKABLE).
MODELS = {
    "llama-3.1-8b": [("q_proj", 4096, 4096), ("kv_proj", 4096, 2048), ("o_proj", 4096, 4096),
                     ("gate_up", 4096, 28672), ("down", 14336, 4096)],
    "qwen2.5-7b": [("q_proj", 3584, 3584), ("kv_proj", 3584, 1024), ("o_proj", 3584, 3584),
                   ("gate_up", 3584, 37888), ("down", 18944, 3584)],
    "deepseek-v2-lite": [("o_proj", 2048, 2048), ("mlp gate_up", 2048, 21888), ("mlp down", 10944, 2048)],
}
# (block_n, block_k, programs, warps, stages)
VARIANTS = [(128, 64, 128, 4, 4), (128, 64, 264, 4, 4), (128, 64, 528, 4, 4), (64, 128, 264, 4, 4),
            (64, 128, 528, 4, 4), (128, 128, 132, 4, 3), (128, 128, 264, 4, 3), (128, 128, 264, 8, 3),
            (64, 256, 264, 4, 3), (64, 256, 528, 4, 3), (32, 256, 528, 4, 4), (256, 64, 264, 8, 3),
            (128, 64, 264, 4, 6), (64, 64, 528, 4, 4)]
STREAM_BYTES = 400e6  # each shape's stack holds at least this many weight bytes (the H100's L2: 50 MB)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="32")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--plan-only", action="store_true", help="only the planned launch beside cuBLAS")
    ap.add_argument("--cpu-smoke", action="store_true", help="a [256, 256] weight in interpret mode (the script's "
                    "own check on a CPU)")
    a = ap.parse_args(argv)
    models, variants, stream = MODELS, VARIANTS, STREAM_BYTES
    if a.plan_only:
        variants = []
    if a.cpu_smoke:
        models, variants, stream, a.models = {"tiny": [("o_proj", 256, 256)]}, VARIANTS[:2], 0, "tiny"
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.decode_matmul import (Launch, decode_matmul, decode_matmul_reference, fewest_chunks,
                                                      plan)

    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    key = jax.random.key(0)
    print("| model | weight | K x N | T | launch | us a layer | weight TB/s | vs cuBLAS |")
    print("|---|---|---|---|---|---|---|---|")
    for model in a.models.split(","):
        for name, K, N in models[model]:
            L = max(2, int(-(-stream // (2 * K * N))))
            w = (jax.random.normal(jax.random.fold_in(key, K * N), (L, K, N), jnp.float32) * 0.02).astype(jnp.bfloat16)
            ws = [w[i] + 0 for i in range(L)]  # each layer its own array
            for T in (int(t) for t in a.tokens.split(",")):
                x = jax.random.normal(jax.random.fold_in(key, T), (T, K), jnp.bfloat16)
                ref = decode_matmul_reference(x, w, 1)
                launches = {"plan": plan(K, N)}
                for bn, bk, progs, nw, ns in variants:
                    if N % bn == 0 and K % bk == 0:
                        launches[f"bn{bn} bk{bk} p{progs} w{nw} s{ns}"] = Launch(
                            bn, bk, fewest_chunks(N // bn, K // bk, progs), nw, ns)
                runs = {"cublas unstacked": timed(jax.jit(lambda x, *ws: tuple(
                    jnp.dot(x, wl, preferred_element_type=jnp.float32) for wl in ws)), x, *ws) / L,
                        "xla stacked": timed(jax.jit(lambda x, w: tuple(
                            jnp.dot(x, w[i], preferred_element_type=jnp.float32) for i in range(L))), x, w) / L}
                for label, lc in launches.items():
                    try:
                        one = jax.jit(lambda x, w, lc=lc: decode_matmul(x, w, 1, **lc._asdict(), interpret=a.cpu_smoke))
                        _check(f"{model} {name} T={T} {label}", one(x, w), ref)
                        every = jax.jit(lambda x, w, lc=lc: tuple(
                            decode_matmul(x, w, i, **lc._asdict(), interpret=a.cpu_smoke) for i in range(L)))
                        runs[label] = timed(every, x, w) / L
                    except Exception as e:  # noqa: BLE001 - a launch that does not fit: report it and go on
                        print(f"| {model} | {name} | {K} x {N} | {T} | {label} {tuple(lc)} | failed: "
                              f"{type(e).__name__}: {str(e)[:160]} | | |", flush=True)
                fastest = min((k for k in runs if k in launches), key=runs.get, default=None)
                for label, us in runs.items():
                    shown = f"{label} {tuple(launches[label])}" if label in launches else label
                    mark = " **fastest**" if label == fastest else ""
                    print(f"| {model} | {name} | {K} x {N} | {T} | {shown}{mark} | {us:.1f} | "
                          f"{2 * K * N / us / 1e6:.2f} | {runs['cublas unstacked'] / us:.2f}x |", flush=True)
            del w, ws
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
