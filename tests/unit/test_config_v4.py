"""V4Config against HF's DeepseekV4Config: the same resolved fields from HF-style and DeepSeek-style
(legacy) config dicts, clear errors on bad input, and the cache bytes per token of each group."""

from __future__ import annotations

import pytest

from deepinfer_jax.config import ConfigError, ModelConfig
from deepinfer_jax.config_v4 import (
    CSA, HCA, SLIDING, V4Config, mla_cache_bytes_per_token, v4_cache_bytes_per_token, v4_cache_fixed_bytes,
)

# DeepSeek's own V4-Flash-style config.json keys (legacy names HF folds in at __post_init__).
LEGACY = dict(
    model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048,
    num_hidden_layers=6, num_attention_heads=64, head_dim=512, q_lora_rank=1024, qk_rope_head_dim=64,
    compress_ratios=[0, 0, 4, 128, 4, 128], num_hash_layers=3, compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                  "beta_fast": 32, "beta_slow": 1},
    index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128, o_groups=8, o_lora_rank=1024,
    swiglu_limit=10.0, hc_mult=4, num_nextn_predict_layers=1, eos_token_id=1,
)


def _hf(d: dict):
    from transformers import DeepseekV4Config

    d = dict(d)
    d.pop("model_type")
    if "rope_scaling" in d:  # HF v5 reads the flat YaRN dict as rope_parameters
        rs = dict(d.pop("rope_scaling"))
        rs["rope_type"] = rs.pop("type")
        d["rope_parameters"] = rs
    return DeepseekV4Config(**d)


def test_legacy_deepseek_keys_resolve_as_hf_does():
    cfg, hf = V4Config.from_hf_dict(LEGACY), _hf(LEGACY)
    assert list(cfg.layer_types) == hf.layer_types == [SLIDING, SLIDING, CSA, HCA, CSA, HCA]
    assert list(cfg.mlp_layer_types) == hf.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] * 3
    assert cfg.qk_rope_head_dim == hf.qk_rope_head_dim == 64
    comp = hf.rope_parameters["compress"]
    rs = cfg.compress_rope_scaling
    assert comp["rope_type"] == "yarn" and comp["attention_factor"] == 1.0
    assert (rs.factor, rs.original_max_position_embeddings) == (comp["factor"], comp["original_max_position_embeddings"])
    assert cfg.compress_rope_theta == comp["rope_theta"] and hf.rope_parameters["main"]["rope_type"] == "default"


def test_hf_saved_dict_and_defaults():
    hf = _hf(dict(model_type="deepseek_v4", num_hidden_layers=5, compress_rates={CSA: 4, HCA: 64}))
    d = hf.to_dict()
    d["model_type"] = "deepseek_v4"
    cfg = V4Config.from_hf_dict(d)
    assert list(cfg.layer_types) == hf.layer_types  # HF's default: 2 HCA then interleaved
    assert cfg.compress_rate(HCA) == 64 and cfg.compress_rate(CSA) == 4 and cfg.compress_rate(SLIDING) == 0
    assert cfg.compress_rope_scaling is None and cfg.scoring_func == "sqrtsoftplus"
    assert cfg.partial_rotary_factor == hf.partial_rotary_factor


@pytest.mark.parametrize("patch, needle", [
    (dict(layer_types=[SLIDING] * 5), "layer_types has 5 entries"),
    (dict(layer_types=["full_attention"] * 6), "layer_types entries must be one of"),
    (dict(compress_ratios=[0, 0, 4, 8, 4, 128]), "compress_ratios entries"),
    (dict(mlp_layer_types=["dense"] * 6), "mlp_layer_types entries"),
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(o_groups=7), "o_groups 7"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(qk_rope_head_dim=0, partial_rotary_factor=0.001), "rotary slice"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "compress rope type 'linear'"),
    (dict(model_type="deepseek_v3"), "deepseek_v4"),
])
def test_bad_config_is_one_clear_error(patch, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        V4Config.from_hf_dict({**LEGACY, **patch})


def test_cache_bytes_per_token_by_group():
    cfg = V4Config.from_hf_dict(LEGACY)  # 2 CSA (m 4), 2 HCA (m 128), 2 sliding layers, head_dim 512
    b = v4_cache_bytes_per_token(cfg, dtype_bytes=2)
    assert b["sliding"] == 0.0
    assert b["csa_rows"] == 2 * 512 * 2 / 4
    assert b["hca_rows"] == 2 * 512 * 2 / 128
    assert b["indexer_keys"] == 2 * 128 * 2 / 4
    assert b["total"] == b["csa_rows"] + b["hca_rows"] + b["indexer_keys"]
    # V3's MLA at the same depth: one (512 + 64)-wide latent row per token per layer.
    v3 = ModelConfig.from_hf_dict(dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=6, num_attention_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
        max_position_embeddings=163840))
    assert mla_cache_bytes_per_token(v3, 2) == 6 * 576 * 2
    assert b["total"] < mla_cache_bytes_per_token(v3, 2) / 2


def test_cache_groups_page_accounting():
    from deepinfer_jax.config_v4 import v4_cache_groups

    cfg = V4Config.from_hf_dict(LEGACY)  # window 128, CSA m 4 on layers 2, 4; HCA m' 128 on 3, 5
    g = {x.name: x for x in v4_cache_groups(cfg, dtype_bytes=2)}
    assert set(g) == {"sliding", "csa", "csa_state", "hca", "hca_state"}
    assert g["csa"].layers == (2, 4) and g["hca"].layers == (3, 5) and g["sliding"].layers == tuple(range(6))
    page = 16
    # Compressed groups: one page per page_size * m tokens; a window still open writes no row.
    assert g["csa"].pages(64 * 3, page) == 3 and g["csa"].pages(64 * 3 + 3, page) == 3
    assert g["csa"].pages(64 * 3 + 4, page) == 4
    assert g["hca"].pages(2048, page) == 1 and g["hca"].pages(2175, page) == 1 and g["hca"].pages(2176, page) == 2 and g["hca"].pages(127, page) == 0
    assert g["csa"].live_pages(10_000, page) == g["csa"].pages(10_000, page)  # nothing is ever dropped
    # The sliding group keeps only pages holding the last window's rows: 128 tokens span 9 pages at most.
    s = g["sliding"]
    assert s.pages(1000, page) == 63 and s.first_live_page(1000, page) == (1000 - 127) // page
    assert max(s.live_pages(n, page) for n in range(1, 5000)) == 128 // page + 1
    assert s.live_pages(100, page) == s.pages(100, page)  # inside the first window nothing is freed
    # Compressor state: the last 2m (CSA) / m' (HCA) tokens' projections.
    assert g["csa_state"].window_tokens == 8 and g["hca_state"].window_tokens == 128
    assert v4_cache_fixed_bytes(cfg, 2) == (6 * 128 * 512 * 2 + 2 * 8 * 4 * (512 + 128) * 2
                                            + 2 * 128 * 2 * 512 * 2)


def test_pools_of_a_context_and_of_a_budget():
    """`v4_cache_pools`: compressed pools one page per page_size x rate tokens of the context (never below
    max_model_len) and a page a sequence; windowed pools max_num_seqs windows and a step's chunk. `v4_fit_pools`:
    the most context within a byte budget."""
    from deepinfer_jax.config_v4 import v4_cache_pools, v4_fit_pools, v4_pool_bytes

    cfg = V4Config.from_hf_dict(LEGACY)  # sliding window 128, CSA m 4 (2 layers), HCA m' 128 (2 layers)
    pools = v4_cache_pools(cfg, 16, 1 + 4096 // 16, 8, 512, 2048)  # 4,096 tokens of context, 8 sequences
    names = [g.name for g in pools.groups]
    pages = dict(zip(names, pools.pool_pages))
    assert pools.pool_of == (0, 1, 2, 3, 4) and pools.context_tokens == 4096
    assert pages["csa"] == 4096 // (16 * 4) + 8 + 1 and pages["hca"] == 4096 // (16 * 128) + 8 + 1
    # a window of 128 holds cdiv(127, 16) + 2 = 10 pages a sequence, plus a 512-token step: 32 pages; csa_state's
    # own pages of 4 rows (page_rows_of(8)): its window of 8 holds cdiv(7, 4) + 2 = 4 a sequence, the step 128
    assert pages["sliding"] == pages["hca_state"] == 8 * 10 + 32 + 1 and pages["csa_state"] == 8 * 4 + 128 + 1
    state = pools.groups[names.index("csa_state")]
    assert state.rows_per_page(16) == 4 and v4_pool_bytes(pools)[2] == pages["csa_state"] * 2 * 4 * 4 * 640 * 2
    # at page size 64, 256 sequences and a step of 2,048 tokens: 16 rows a sequence where pages of 64 held 192
    big = v4_cache_pools(cfg, 64, 2, 256, 2048, 2048)
    assert big.pool_pages[2] * state.rows_per_page(64) == 256 * 16 + 2048 + 4
    assert v4_pool_bytes(pools)[1] == pages["csa"] * 2 * 16 * (512 + 128) * 2
    assert v4_cache_pools(cfg, 16, 1, 8, 512, 2048).context_tokens == 2048  # at least max_model_len
    budget = sum(v4_pool_bytes(pools))
    fit = v4_fit_pools(cfg, 16, budget, 8, 512, 2048)
    assert sum(v4_pool_bytes(fit)) <= budget < sum(v4_pool_bytes(v4_cache_pools(
        cfg, 16, fit.context_tokens // 16 + 2, 8, 512, 2048)))
    assert fit.context_tokens >= 4096
