"""A decode MoE layer's launches from o_proj's partials to the combined expert output, per variant (profiler trace).

    python benchmarks/moe_launch_sweep.py [--batch 32] [--layers 4] [--variants two,merged,...]

One jitted program runs `--layers` MoE layers at V2-Lite's shape (D 2048, 64 experts of 1,408 + 2 shared, top-6,
random bf16 weights, each layer its own so no weight stays in L2) on random partials and residuals, as a decode
step's MoE layers do: either the route launch then the experts' single launch (kernels/residual_route.py, then
moe_route.moe_fused_decode) or the two as one launch (kernels/route_experts.py). A profiler trace of a few runs
gives each kernel's device time per layer and the span per layer (first kernel's start to last one's end, the gaps
included). Each variant's output is checked against the first one's. The table prints last.
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

VARIANTS = {  # name -> (launch, keyword arguments): "two" = residual_route + moe_fused_decode, "one" = route_experts
    "two": ("two", {}),
    "two_w4": ("two", {"num_warps": 4}),  # the route launch at the experts' 4 warps
    "merged": ("one", {}),  # route_experts' defaults: 8 warps, the shared down tiles after the routed gate_up tiles
    "merged_early": ("one", {"shared_down_late": False}),
    "merged_w4": ("one", {"num_warps": 4}),
    "merged_w4_early": ("one", {"num_warps": 4, "shared_down_late": False}),
}
for _t in ((32, 64, 256), (32, 32, 256), (32, 16, 256), (16, 64, 256), (16, 32, 256), (32, 32, 128), (32, 64, 128)):
    # the shared experts' tiles (rows, gate_up columns, down columns); the routed 16 / 128 / 256
    VARIANTS["sh%d_%d_%d" % _t] = ("one", {"shared_tiles": _t})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--hidden", type=int, default=2048, help="D (a CPU smoke test: e.g. 256)")
    ap.add_argument("--inter", type=int, default=1408, help="an expert's width I (a CPU smoke test: e.g. 128)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from benchmarks.trace_tools import gpu_kernels
    from deepinfer_jax.kernels import moe_route, residual_route, route_experts

    T, D, E, I, S, k, L = args.batch, args.hidden, 64, args.inter, 2, 6, args.layers
    interpret = jax.default_backend() == "cpu"  # CPU: a smoke test (--layers 1 --hidden 256 --inter 128)
    keys = iter(jax.random.split(jax.random.key(0), 10))
    rnd = lambda shape, scale: (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(jnp.bfloat16)  # noqa: E731
    parts = jax.random.normal(next(keys), (8, T, D), jnp.float32) * 0.3
    h = rnd((T, D), 1.0)
    norm_w = jnp.ones((L, D), jnp.bfloat16)
    gate = rnd((L, D, E), 0.05)
    wgu, wd = rnd((L, E, D, 2, I), 0.02), rnd((L, E, I, D), 0.02)
    sgu, sd = rnd((L, D, 2, S * I), 0.02), rnd((L, S * I, D), 0.02)
    kw = dict(eps=1e-6, k=k)
    rows, ref = [], None
    for name in args.variants.split(","):
        launch, vkw = VARIANTS[name]

        @jax.jit
        def layers(parts, h, norm_w, gate, wgu, wd, sgu, sd, launch=launch, vkw=vkw):  # weights as operands, not
            # constants folded into the program
            outs, idxs = [], []
            for j in range(L):
                if launch == "two":
                    hn, x, *routed = residual_route.residual_route(
                        parts, h, norm_w, gate, j, num_shared=S, block_m=moe_route.decode_block_m(T, k, S),
                        interpret=interpret, **kw, **vkw)
                    out, idx = moe_route.moe_fused_decode(x, None, None, wgu, wd, j, sgu, sd, k=k, single_launch=True,
                                                          routed=tuple(routed), interpret=interpret)
                else:
                    hn, x, out, idx = route_experts.route_experts(parts, h, norm_w, gate, j, wgu, wd, sgu, sd,
                                                                  interpret=interpret, **kw, **vkw)
                outs.append(hn + out)
                idxs.append(idx)
            return jnp.stack(outs), jnp.stack(idxs)

        operands = (parts, h, norm_w, gate, wgu, wd, sgu, sd)
        out, idx = jax.block_until_ready(layers(*operands))
        # the bytes a layer must read: its touched experts' and the shared experts' weights, the router's
        touched = float(np.mean([len(np.unique(np.asarray(i))) for i in idx]))
        layer_bytes = (touched + S) * 3 * D * I * 2 + D * E * 2
        ref = out if ref is None else ref
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        d = tempfile.mkdtemp()
        runs = 3
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(runs):
                jax.block_until_ready(layers(*operands))
        per_name, spans = defaultdict(float), []
        events = sorted(gpu_kernels(d) or [], key=lambda e: e["ts"])
        for e in events:
            per_name[e["name"]] += e.get("dur", 0.0) / (runs * L)
        # the runs' spans: events split where the GPU idles over 100 us (between two runs' host calls)
        start = end = None
        for e in events:
            if start is not None and e["ts"] - end > 100:
                spans.append(end - start)
                start = None
            start = e["ts"] if start is None else start
            end = max(end or 0.0, e["ts"] + e.get("dur", 0.0))
        if start is not None:
            spans.append(end - start)
        span = float(np.median(spans)) / L if spans else float("nan")
        top = ", ".join(f"{n} {us:.1f}" for n, us in sorted(per_name.items(), key=lambda kv: -kv[1])[:4])
        rows.append((name, sum(per_name.values()), span, f"{touched:.1f} experts, {layer_bytes / span / 1e6:.2f} TB/s "
                     f"over the span; max diff {err:.2e}; {top}"))
        print(rows[-1], flush=True)
    print(f"\n| variant | kernels, us / layer | span, us / layer | touched experts, bytes / span; check; the largest "
          f"kernels, us / layer |"
          f"  (batch {T}, {L} layers)")
    print("|---|---|---|---|")
    for name, us, span, note in rows:
        print(f"| {name} | {us:.1f} | {span:.1f} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
