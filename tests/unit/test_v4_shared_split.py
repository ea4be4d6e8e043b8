"""DeepSeek-V4's shared expert over the tensor axis (sharding/rules.py v4_splits_shared): its intermediate dim splits
where the tensor degree divides it, and, kept in FP8 as released, only into whole blocks; otherwise it stays whole on
every device. `deepinfer plan`'s per-device bytes (v4_bytes_per_device) follow the same decision. The engine's
tokens and allocated bytes under these layouts are tests/sharding/test_v4_sharded.py's."""

from __future__ import annotations

import pytest

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.sharding.mesh import ParallelConfig
from deepinfer_jax.sharding.rules import v4_bytes_per_device, v4_rules, v4_splits_shared

# V4-Flash's shape (its moe_intermediate_size 2048, or 3072); FP8 blocks of 128 x 128 as released.
FLASH = dict(
    model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048,
    num_hidden_layers=2, num_attention_heads=64, head_dim=512, q_lora_rank=1024, qk_rope_head_dim=64,
    compress_ratios=[0, 4], num_hash_layers=1, index_n_heads=64, index_head_dim=128, index_topk=512,
    sliding_window=128, o_groups=8, o_lora_rank=1024, swiglu_limit=10.0, hc_mult=4, n_routed_experts=256,
    num_experts_per_tok=6, eos_token_id=1,
)
BLOCK = (128, 128)


def _cfg(width: int) -> ModelConfig:
    return ModelConfig.from_hf_dict({**FLASH, "moe_intermediate_size": width})


@pytest.mark.parametrize("width,tp,block,split", [
    (2048, 8, BLOCK, True),  # 256 columns a device: two whole blocks
    (2048, 16, BLOCK, True),
    (3072, 8, BLOCK, True),  # 384 = 3 blocks
    (3072, 16, BLOCK, False),  # 192 columns: a block would straddle two devices, so whole
    (3072, 16, None, True),  # the same in float (a bf16 checkpoint, or --quantization none) splits
    (24, 5, None, False),  # a degree that does not divide the width: whole, as the attention does
    (24, 1, None, False),
])
def test_the_shared_expert_splits_only_where_each_device_gets_whole_blocks(width, tp, block, split):
    cfg, pc = _cfg(width), ParallelConfig(tp, 1, True)
    assert v4_splits_shared(cfg, pc, block) is split
    assert dict(v4_rules(pc, cfg, block))["mlp"] == (("tensor",) if split else ())


def test_plan_divides_the_shared_experts_bytes_by_tp_only_when_split():
    cfg, pc = _cfg(3072), ParallelConfig(16, 1, True)
    shared = {("layers", 0, "moe", "shared", "gate_up"): 3200, ("layers", 0, "moe", "shared", "down"): 1600}
    other = {("layers", 0, "moe", "gate"): 48, ("embed",): 96}
    assert v4_bytes_per_device(cfg, pc, {**shared, **other}, BLOCK) == 3200 + 1600 + 48 + 96
    assert v4_bytes_per_device(cfg, pc, {**shared, **other}, None) == (3200 + 1600) // 16 + 48 + 96
