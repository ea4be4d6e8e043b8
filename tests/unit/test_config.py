"""ModelConfig from HF config.json: presets carry DeepSeek's published values; bad configs are named."""

from __future__ import annotations

import json
import os

import pytest

from deepinfer_jax.config import CacheConfig, ConfigError, ModelConfig

PRESETS = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models")


def preset(name: str) -> ModelConfig:
    return ModelConfig.from_json_file(os.path.join(PRESETS, f"{name}.json"))


def raw(name: str) -> dict:
    with open(os.path.join(PRESETS, f"{name}.json")) as f:
        return json.load(f)


def test_v2_lite_preset():
    c = preset("deepseek-v2-lite")
    assert (c.model_type, c.q_lora_rank, c.topk_method, c.scoring_func) == ("deepseek_v2", None, "greedy", "softmax")
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.first_k_dense_replace) == (64, 6, 2, 1)
    assert c.kv_cache_dim == 576 and c.qk_head_dim == 192
    assert c.rope_scaling.mscale == 0.707 and c.rope_scaling.factor == 40
    assert c.softmax_scale == pytest.approx(0.1147214, abs=1e-7)
    assert not c.has_e_score_correction_bias and not c.norm_topk_prob


def test_v3_preset():
    c = preset("deepseek-v3")
    assert (c.q_lora_rank, c.topk_method, c.scoring_func, c.n_group, c.topk_group) == (1536, "noaux_tc", "sigmoid", 8, 4)
    assert c.routed_scaling_factor == 2.5 and c.norm_topk_prob and c.has_e_score_correction_bias
    assert c.num_nextn_predict_layers == 1 and c.first_k_dense_replace == 3
    assert c.softmax_scale == pytest.approx(0.1352338, abs=1e-7)
    assert [c.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]


def test_moonlight_preset_plain_rope():
    c = preset("moonlight-16b-a3b")
    assert c.rope_scaling is None and c.rope_theta == 50000 and c.rms_norm_eps == 1e-5
    assert c.softmax_scale == pytest.approx(0.0721688, abs=1e-7)
    assert c.eos_token_ids == (163586,)


def test_hf_v5_rope_parameters_form():
    d = raw("deepseek-v3")
    rs = d.pop("rope_scaling")
    d["rope_parameters"] = {**{k: v for k, v in rs.items() if k != "type"}, "rope_type": "yarn", "rope_theta": 10000.0}
    assert ModelConfig.from_hf_dict(d).rope_scaling == preset("deepseek-v3").rope_scaling


def test_moe_layer_freq():
    d = dict(raw("tiny-deepseek-v2"), num_hidden_layers=6, first_k_dense_replace=1, moe_layer_freq=2)
    c = ModelConfig.from_hf_dict(d)
    assert [c.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gemma"}, "model_type 'gemma'.? is not supported; supported: .*LlamaForCausalLM"),
        ({"topk_method": "sinkhorn"}, "topk_method 'sinkhorn'"),
        ({"scoring_func": "relu"}, "scoring_func 'relu'"),
        ({"n_group": 3}, "not divisible by n_group 3"),
        ({"topk_group": 9, "n_group": 4}, "topk_group 9 exceeds n_group 4"),
        ({"rope_scaling": {"type": "longrope", "factor": 2}}, "rope_scaling type 'longrope'"),
        ({"rope_scaling": {"type": "yarn"}}, "needs 'factor'"),
        ({"kv_lora_rank": None}, "needs 'kv_lora_rank'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_experts_per_tok": 30}, "num_experts_per_tok 30 exceeds"),
    ],
)
def test_bad_configs_are_named(change, message):
    d = dict(raw("tiny-deepseek-v3"), **change)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(d)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        ModelConfig.from_model_dir(str(tmp_path))


def test_cache_config_validation():
    with pytest.raises(ValueError, match="page_size"):
        CacheConfig(page_size=48)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)


DENSE = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)


def test_dense_families_parse():
    c = ModelConfig.from_hf_dict(dict(DENSE, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                           "original_max_position_embeddings": 64}))
    assert (c.family, c.head_dim, c.num_key_value_heads, c.attention_bias, c.qk_norm) == ("dense", 8, 2, False, False)
    assert c.rope_scaling.rope_type == "llama3" and c.rope_scaling.high_freq_factor == 4.0
    q2 = ModelConfig.from_hf_dict(dict(DENSE, model_type="qwen2", tie_word_embeddings=True))
    assert q2.attention_bias and q2.tie_word_embeddings
    q3 = ModelConfig.from_hf_dict(dict(DENSE, model_type="qwen3", head_dim=32))
    assert q3.qk_norm and q3.head_dim == 32
    assert ModelConfig.from_hf_dict(dict(DENSE, model_type="mistral", sliding_window=4096)).sliding_window == 4096
    assert ModelConfig.from_hf_dict(dict(DENSE, sliding_window=4096)).sliding_window is None  # llama has none
    moe = ModelConfig.from_hf_dict(dict(DENSE, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, norm_topk_prob=True))
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.qk_norm, moe.is_moe_layer(1)) == (8, 2, True, True)


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias=True is not supported for llama"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=True is not supported for qwen2"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling type 'longrope'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0}}, "needs 'factor' and 'original_max_position"),
    ({"intermediate_size": None}, "needs 'intermediate_size'"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "mlp_only_layers": [0]}, "mlp_only_layers=\\[0\\]"),
])
def test_bad_dense_configs_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(dict(DENSE, **change))
