"""Cache bytes per token of DeepSeek-V4's cache groups against V2 / V3's MLA latent, from configs alone.

    python benchmarks/v4_cache_bytes.py [CONFIG_JSON_OR_DIR ...] [--dtype-bytes 2] [--contexts 8192,65536,262144,1048576]

Each argument is a config.json (or a directory holding one) of model_type deepseek_v4, deepseek_v3 or
deepseek_v2; with none, HF's default DeepseekV4Config (43 layers, V4-Flash's width) and DeepSeek-V3's
published shape (61 layers, latent 512 + 64) are compared. Prints, per model: the bytes per token of each
growing group, the fixed bytes per sequence (sliding rings, compressor state) and the total per sequence
at each context. Arithmetic from the config (`config_v4.v4_cache_bytes_per_token`), not a device
measurement: `benchmarks/v4_long_context.py` allocates the engine's per-group pools on the device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from deepinfer_jax.config import ModelConfig  # noqa: E402
from deepinfer_jax.config_v4 import (  # noqa: E402
    V4Config, mla_cache_bytes_per_token, v4_cache_bytes_per_token, v4_cache_fixed_bytes,
)

V3_SHAPE = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
    max_position_embeddings=163840,
)


def _load(arg: str) -> dict:
    path = os.path.join(arg, "config.json") if os.path.isdir(arg) else arg
    with open(path) as f:
        return json.load(f)


def row(name: str, d: dict, dtype_bytes: int, contexts: list[int]) -> tuple:
    if d.get("model_type") == "deepseek_v4":
        cfg = V4Config.from_hf_dict(d)
        per = v4_cache_bytes_per_token(cfg, dtype_bytes)
        fixed = v4_cache_fixed_bytes(cfg, dtype_bytes)
        groups = ", ".join(f"{k} {v:,.0f}" for k, v in per.items() if k != "total" and v)
        total = per["total"]
    else:
        cfg = ModelConfig.from_hf_dict(d)
        total, fixed = float(mla_cache_bytes_per_token(cfg, dtype_bytes)), 0
        groups = f"latent {total:,.0f}"
    return name, groups, total, fixed, [(c, fixed + total * c) for c in contexts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*")
    ap.add_argument("--dtype-bytes", type=int, default=2)
    ap.add_argument("--contexts", default="8192,65536,262144,1048576")
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    models = [(c, _load(c)) for c in a.configs] or [
        ("deepseek_v4 (HF defaults)", {"model_type": "deepseek_v4"}), ("deepseek_v3 (61 layers)", V3_SHAPE)]
    table = [row(name, d, a.dtype_bytes, contexts) for name, d in models]
    print(f"cache bytes, {a.dtype_bytes} bytes per element (from the configs, not measured)")
    for name, groups, total, fixed, per_ctx in table:
        print(f"\n{name}\n  per token: {total:,.0f}  ({groups})\n  fixed per sequence: {fixed / 2**20:,.1f} MiB")
        for c, b in per_ctx:
            print(f"  {c:>9,} tokens: {b / 2**30:8.2f} GiB per sequence")


if __name__ == "__main__":
    main()
