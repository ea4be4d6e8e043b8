"""The routed experts of one MoE layer (tiny DeepSeek-V3 config, fp32, random params) under expert parallelism,
all-gather and all-to-all dispatch against the single-device code, on 8 fake CPU devices; prints one line
"RESULT " + JSON {case: max |difference| to the single-device output}.

    python tests/sharding/run_moe_dispatch.py

Cases "LAYOUT/DISPATCH/CASE": LAYOUT "TPxDPep" as run_case.py; DISPATCH "gather" or "a2a"; CASE "block" (the
whole MoE block: the model's own routing of random tokens, routed and shared experts), "hlo_all_to_all" (whether
the block's compiled program has an all-to-all), or the routed experts alone with a fixed routing: "balanced"
(each token's experts on one device, every device receiving an equal share: the all-to-all runs its smallest
buffer) or "skewed" (every token to the experts of device 0: the dropless worst case).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

LAYOUTS = ["2x2ep", "1x4ep", "1x8ep", "4x1ep"]  # DP2 x EP4 (TP2), DP4 x EP4, DP8 x EP8, EP4 over TP4 alone
EPLB_LAYOUTS = ["2x2ep", "1x8ep"]
TOKENS = 72  # 9 a data rank at DP 8, slices of 18 a device at DP 2 x TP 2
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
              v_head_dim=8, first_k_dense_replace=1, max_position_embeddings=64, model_type="deepseek_v3",
              q_lora_rank=None, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
              topk_group=2, topk_method="noaux_tc", routed_scaling_factor=2.5, norm_topk_prob=True,
              rms_norm_eps=1e-6)


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models.moe import experts_ragged, experts_sharded, moe_block
    from deepinfer_jax.models.params import init_params
    from deepinfer_jax.sharding import ParallelConfig, build_sharding

    cfg = ModelConfig.from_hf_dict(CONFIG)
    moe = jax.tree.map(lambda a: a[0], init_params(cfg, seed=3)["segments"][1]["moe"])  # the MoE layer
    moe = jax.tree.map(lambda a: a * 10 if a.ndim > 1 else a, moe)  # a router far from flat
    x_all = jnp.asarray(np.random.default_rng(0).standard_normal((TOKENS, cfg.hidden_size)), jnp.float32)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    w_all = jnp.asarray(np.random.default_rng(1).uniform(0.1, 1.0, (TOKENS, k)), jnp.float32)
    out = {}
    for layout in LAYOUTS:
        tp, dp = (int(v) for v in layout.removesuffix("ep").split("x"))
        T = TOKENS if dp > 1 else TOKENS - 2  # one data rank: 70 tokens, which TP = 4 does not divide (padded)
        x, w_fixed, t = x_all[:T], w_all[:T], np.arange(T)
        n = tp * dp
        per = E // n
        # balanced: token t's k copies on device t % n; skewed: every copy on device 0 (ids may repeat when a
        # device holds fewer than k experts: each copy is computed and weighted, as anywhere else)
        bal = (t % n)[:, None] * per + np.arange(k)[None, :] % per
        skew = np.broadcast_to(np.arange(k) % per, (T, k))
        routings = {"balanced": (w_fixed, jnp.asarray(bal, jnp.int32)),
                    "skewed": (w_fixed, jnp.asarray(skew, jnp.int32))}
        for dispatch in ("gather", "a2a"):
            backend = "all_to_all" if dispatch == "a2a" else "allgather_reducescatter"
            mr = build_sharding(cfg, ParallelConfig(tp, dp, True, all2all_backend=backend)).mesh_rules
            tok = jax.sharding.NamedSharding(mr.mesh, mr.spec(("tokens", None)))
            block = jax.jit(lambda p, x: moe_block(p, cfg, x, "ragged", mesh_rules=mr)).lower(
                moe, jax.device_put(x, tok)).compile()
            full = block(moe, jax.device_put(x, tok))
            out[f"{layout}/{dispatch}/block"] = float(jnp.max(jnp.abs(full - moe_block(moe, cfg, x, "ragged"))))
            out[f"{layout}/{dispatch}/hlo_all_to_all"] = "all-to-all" in block.as_text()
            if dispatch == "gather":
                continue  # the all-gather form's own tests: test_sharded_greedy.py
            for name, (w, idx) in routings.items():
                got = jax.jit(lambda e, x, w, i: experts_sharded(mr, "ragged", e, x, w, i, None))(
                    moe["experts"], *(jax.device_put(a, tok) for a in (x, w, idx)))
                out[f"{layout}/{dispatch}/{name}"] = float(jnp.max(jnp.abs(got - experts_ragged(moe["experts"], x, w,
                                                                                              idx))))
    # EPLB: 8 redundant slots (24 physical experts), a flat placement and one rebalanced for skewed counts, each
    # applied through the same compiled block: outputs as the logical experts' on one device
    from deepinfer_jax.models.eplb_map import physical_experts
    from deepinfer_jax.sharding.eplb import default_placement, rebalance

    x = x_all
    want = moe_block(moe, cfg, x, "ragged")
    for layout in EPLB_LAYOUTS:
        tp, dp = (int(v) for v in layout.removesuffix("ep").split("x"))
        skew_load = np.random.default_rng(2).permutation(1000.0 / np.arange(1, E + 1) ** 1.5)[None]
        placements = {"flat": default_placement(1, E, 8, tp * dp), "rebalanced": rebalance(skew_load, E + 8, tp * dp)}
        for dispatch in ("none", "gather", "a2a"):
            backend = "all_to_all" if dispatch == "a2a" else "allgather_reducescatter"
            mr = None if dispatch == "none" else build_sharding(cfg, ParallelConfig(tp, dp, True, all2all_backend=backend)).mesh_rules
            f = jax.jit(lambda p, x: moe_block(p, cfg, x, "ragged", mesh_rules=mr))
            xs = x if mr is None else jax.device_put(x, jax.sharding.NamedSharding(mr.mesh, mr.spec(("tokens", None))))
            for name, pl in placements.items():
                p = {**moe, "experts": physical_experts(moe["experts"], jnp.asarray(pl.phys_to_log[0])),
                     "eplb": {"log_to_phys": jnp.asarray(pl.log_to_phys[0]), "replicas": jnp.asarray(pl.replicas[0])}}
                out[f"{layout}/{dispatch}/eplb_{name}"] = float(jnp.max(jnp.abs(f(p, xs) - want)))
            out[f"{layout}/{dispatch}/eplb_compiles"] = f._cache_size()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
