"""Expert-parallel token dispatch on several GPUs: the all-to-all form against the all-gather form (the multi-GPU
issue), one MoE layer's routed experts at EP 2, 4 and 8.

    python benchmarks/ep_dispatch.py [--preset deepseek-v3] [--ep 2 4 8] [--tokens 64 2048] [--tp 1]
        [--moe-impl pallas] [--skew 0] [--iters 20]

For each EP degree (DP = EP / TP data ranks, the experts over all EP devices) and each step size (--tokens token
slots a data rank), draws one layer's expert weights (bf16, --preset's shapes; the expert count is cut to what
--max-expert-gib allows per device, a multiple of the EP degree) and a routing of random tokens (top-k of random
scores, --skew > 0 tilting them towards low expert ids), then:

1. correctness: the all-to-all output against the all-gather output (and against one device through the XLA
   reference where the layer fits --max-expert-gib), the largest |difference| relative to the output's largest
   magnitude; a row over --tol stops the run;
2. timing: each form's jitted step, --iters runs after warm-up, median milliseconds,

and prints one table: EP, TP, tokens a rank, the all-to-all's capacity rung (rows a device) and both times. The
bytes sharding/comm.py predicts for each form are printed beside them, so the times can be read against the link.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _config(preset: str, experts: int | None):
    from deepinfer_jax.config import ModelConfig

    with open(os.path.join(os.path.dirname(HERE), "configs", "models", f"{preset}.json")) as f:
        d = json.load(f)
    if experts:
        d["n_routed_experts"] = experts
        d["n_group"], d["topk_group"] = 1, 1
    return ModelConfig.from_hf_dict(d)


def _routing(key, tokens: int, E: int, k: int, skew: float):
    import jax
    import jax.numpy as jnp

    scores = jax.random.uniform(key, (tokens, E)) - skew * jnp.arange(E) / E
    w, idx = jax.lax.top_k(scores, k)
    return jax.nn.softmax(w, axis=-1).astype(jnp.float32), idx.astype(jnp.int32)


def _time(f, args, iters: int) -> float:
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--ep", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--tp", type=int, default=1, help="TP inside each EP group (DP = EP / TP)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 2048], help="token slots a data rank")
    ap.add_argument("--moe-impl", default="pallas", choices=["pallas", "ragged"])
    ap.add_argument("--skew", type=float, default=0.0, help="0: uniform routing; 1+: hot low-id experts")
    ap.add_argument("--max-expert-gib", type=float, default=12.0, help="expert weights a device at most")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tol", type=float, default=2e-2, help="largest relative |a2a - gather| accepted (bf16)")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.models.moe import experts_ragged, experts_sharded
    from deepinfer_jax.models.moe_a2a import capacity_ladder
    from deepinfer_jax.sharding import ParallelConfig, build_sharding
    from deepinfer_jax.sharding.comm import step_collectives

    n_dev = jax.device_count()
    print(f"{n_dev} x {jax.devices()[0].device_kind}; preset {a.preset}, moe_impl {a.moe_impl}, skew {a.skew}")
    print(f"{'EP':>3s} {'TP':>3s} {'E':>4s} {'tokens':>7s} {'rung':>5s} {'max rel diff':>12s} {'gather ms':>10s} "
          f"{'a2a ms':>8s} {'a2a/gather':>10s} {'gather MiB':>10s} {'a2a MiB':>8s}")
    for ep in a.ep:
        if ep > n_dev or ep % a.tp:
            print(f"EP {ep}: skipped ({n_dev} devices, TP {a.tp})")
            continue
        full = _config(a.preset, None)
        D, I, k = full.hidden_size, full.moe_intermediate_size, full.num_experts_per_tok
        per_expert_gib = 3 * D * I * 2 / 2**30
        E = min(full.n_routed_experts, int(a.max_expert_gib / per_expert_gib) * ep) // ep * ep
        cfg = _config(a.preset, E if E != full.n_routed_experts else None)
        rng = jax.random.split(jax.random.PRNGKey(ep), 4)
        for tokens in a.tokens:
            dp = ep // a.tp
            T = tokens * dp
            out = {}
            for backend in ("allgather_reducescatter", "all_to_all"):
                mr = build_sharding(cfg, ParallelConfig(a.tp, dp, True, all2all_backend=backend)).mesh_rules
                ns = lambda *axes: jax.sharding.NamedSharding(mr.mesh, mr.spec(axes))  # noqa: E731
                ex = {"gate_up": jax.device_put(
                          (jax.random.normal(rng[0], (E, D, 2, I), jnp.float32) * 0.02).astype(jnp.bfloat16),
                          ns("expert", None, None, None)),
                      "down": jax.device_put((jax.random.normal(rng[1], (E, I, D), jnp.float32) * 0.02
                                              ).astype(jnp.bfloat16), ns("expert", None, None))}
                x = jax.device_put(jax.random.normal(rng[2], (T, D), jnp.bfloat16), ns("tokens", None))
                w, idx = (jax.device_put(v, ns("tokens", None)) for v in _routing(rng[3], T, E, k, a.skew))
                f = jax.jit(lambda e, x, w, i, mr=mr: experts_sharded(mr, a.moe_impl, e, x, w, i, None))
                y = f(ex, x, w, idx)
                out[backend] = (np.asarray(y.astype(jnp.float32)), _time(f, (ex, x, w, idx), a.iters))
                if backend == "all_to_all" and E * per_expert_gib <= a.max_expert_gib:  # fits one device
                    one = jax.devices()[0]
                    ex1, x1, w1, i1 = jax.device_put((ex, x, w, idx), one)
                    out["one device"] = (np.asarray(experts_ragged(ex1, x1, w1, i1).astype(jnp.float32)), 0.0)
                del ex
            ref, got = out["allgather_reducescatter"][0], out["all_to_all"][0]
            rel = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-12))
            if "one device" in out:
                one = out.pop("one device")[0]
                rel = max(rel, float(np.max(np.abs(got - one)) / max(np.max(np.abs(one)), 1e-12)))
            # the rung the step ran on: the largest count any source sends to any device, up the ladder
            dest = np.asarray(idx) // (E // ep)
            Ts = -(-tokens // a.tp)
            need = 0
            for s in range(ep):
                rows = dest[s * Ts:(s + 1) * Ts]
                for j in range(ep):
                    need = max(need, int(np.any(rows == j, axis=1).sum()))
            rung = next(c for c in capacity_ladder(Ts) if c >= need)
            mib = {}
            for backend, cap in (("allgather_reducescatter", None), ("all_to_all", rung)):
                pc = ParallelConfig(a.tp, dp, True, all2all_backend=backend)
                mib[backend] = sum(c.bytes_per_device for c in step_collectives(cfg, pc, tokens, 1, 2, cap)
                                   if c.what.startswith("routed")) / 2**20  # one layer
            g, t = out["allgather_reducescatter"][1], out["all_to_all"][1]
            print(f"{ep:3d} {a.tp:3d} {E:4d} {tokens:7d} {rung:5d} {rel:12.2e} {g:10.3f} {t:8.3f} {t / g:10.2f} "
                  f"{mib['allgather_reducescatter']:10.2f} {mib['all_to_all']:8.2f}")
            if rel > a.tol:
                print(f"FAIL: all-to-all differs from all-gather by {rel:.2e} (> --tol {a.tol})")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
