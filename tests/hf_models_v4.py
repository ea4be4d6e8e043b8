"""Tiny random DeepSeek-V4 checkpoints built with HF transformers (the numerics reference).

One fp32 model with every attention layer type (sliding, CSA, HCA) and both MLP types (hash_moe, moe),
odd sizes where the arithmetic allows (vocab 101, 3 hyper-connection streams, 13 index heads, a rotary
slice of 6 in a head of 24), a YaRN compress rope, and every parameter HF initialises to a constant (sinks, position biases, hyper-connection base / scale, hash
table, correction bias, norms) randomised so each one matters in the comparison.
"""

from __future__ import annotations

V4_TINY = dict(
    vocab_size=101, hidden_size=40, moe_intermediate_size=24, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=24, q_lora_rank=20,
    partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=6, n_shared_experts=1,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5,
    max_position_embeddings=64, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                     "beta_fast": 32, "beta_slow": 1},
    layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    hc_mult=3, hc_sinkhorn_iters=20, hc_eps=1e-6, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    swiglu_limit=0.9, sliding_window=8, o_groups=2, o_lora_rank=10, index_n_heads=13, index_head_dim=12,
    index_topk=3, num_nextn_predict_layers=0, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False, initializer_range=0.1,
)


def build_hf_v4(seed: int = 0, **overrides):
    """An fp32 eval-mode `DeepseekV4ForCausalLM` with every constant-initialised parameter randomised."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**{**V4_TINY, **overrides})
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("scale", "hc_scale")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", "position_bias", "base", "hc_base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.rand(b.shape, generator=g))
            elif name.endswith("tid2eid"):
                E = cfg.n_routed_experts
                b.copy_(torch.stack([torch.randperm(E, generator=g)[: cfg.num_experts_per_tok]
                                     for _ in range(b.shape[0])]))
    model.config._attn_implementation = "eager"
    return model
