"""Sharding rules, refusals and the data-parallel host side, in-process (no mesh of many devices needed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from hf_models import CASES, COMMON
from deepinfer_jax.config import CacheConfig, ModelConfig, SchedulerConfig
from deepinfer_jax.models.parallel import logical_to_spec
from deepinfer_jax.sharding import (
    KV_CACHE_AXES, ParallelConfig, check_rules, default_rules, make_mesh, param_partition_specs,
)
from deepinfer_jax.sharding.data_parallel import DPScheduler, merge_rank_steps
from deepinfer_jax.types import Request, SamplingParams

DT = ("data", "tensor")


def cfg_of(case: str, **overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict({**COMMON, **CASES[case], **overrides})


def mesh_shape(pc: ParallelConfig) -> dict:
    return {"data": pc.data_parallel_size, "tensor": pc.tensor_parallel_size}


@pytest.mark.parametrize("ep", [False, True])
def test_default_rules_place_every_leaf(ep):
    cfg = cfg_of("v3_grouped_noaux")  # q-LoRA, noaux bias, one dense layer then MoE layers
    rules = default_rules(ParallelConfig(2, 2, ep))
    specs = param_partition_specs(cfg, rules)
    dense, moe = specs["segments"]
    assert specs["embed"] == P("tensor", None) and specs["lm_head"] == P(None, "tensor")
    assert specs["final_norm"] == P(None)
    attn = moe["attn"]
    assert attn["q_a_proj"] == P(None, None, None)  # latent projections: replicated
    assert attn["q_b_proj"] == P(None, None, "tensor", None)  # heads split (TP)
    assert attn["kv_a_proj_with_mqa"] == P(None, None, None)
    assert attn["kv_b_proj"] == P(None, None, "tensor", None)
    assert attn["o_proj"] == P(None, "tensor", None, None)
    assert dense["mlp"]["gate_up"] == P(None, None, None, "tensor") and dense["mlp"]["down"] == P(None, "tensor", None)
    assert moe["moe"]["shared"]["gate_up"] == P(None, None, None, "tensor")
    assert moe["moe"]["gate"] == P(None, None, None) and moe["moe"]["e_score_correction_bias"] == P(None, None)
    ex = moe["moe"]["experts"]
    if ep:  # experts split over all TP x DP devices
        assert ex["gate_up"] == P(None, DT, None, None, None) and ex["down"] == P(None, DT, None, None)
    else:  # each expert's intermediate dim split over all TP x DP devices
        assert ex["gate_up"] == P(None, None, None, None, DT) and ex["down"] == P(None, None, DT, None)
    assert logical_to_spec(KV_CACHE_AXES, rules) == P(None, "data", None, None)  # pages over data ranks
    check_rules(cfg, mesh_shape(ParallelConfig(2, 2, ep)), rules)


def test_changing_a_layout_is_editing_the_rules():
    cfg = cfg_of("v2_greedy_yarn")
    rules = tuple((k, ("tensor",) if k == "embed" else v) for k, v in default_rules(ParallelConfig(2)))
    rules = tuple((k, () if k == "vocab" else v) for k, v in rules)
    specs = param_partition_specs(cfg, rules)
    assert specs["embed"] == P(None, "tensor") and specs["segments"][1]["attn"]["kv_a_proj_with_mqa"] == P(None, "tensor", None)


TP, DP = "--tensor-parallel-size", "--data-parallel-size"


@pytest.mark.parametrize("case,overrides,pc,match", [
    ("v2_greedy_yarn", dict(num_attention_heads=5, num_key_value_heads=5), ParallelConfig(2),
     f"num_attention_heads = 5 .*; change {TP}$"),
    ("v2_greedy_yarn", dict(num_attention_heads=4), ParallelConfig(8), "num_attention_heads = 4"),
    ("v2_greedy_yarn", dict(n_routed_experts=10), ParallelConfig(4, 1, True),
     f"n_routed_experts = 10 .*change {DP} or {TP} .*drop --enable-expert-parallel"),
    ("v3_grouped_noaux", {}, ParallelConfig(4, 8, True), "n_routed_experts = 16"),
    ("v2_greedy_yarn", dict(moe_intermediate_size=30), ParallelConfig(2, 2, False),
     "moe_intermediate_size = 30 .*set --enable-expert-parallel"),
    ("v2_greedy_yarn", dict(intermediate_size=90), ParallelConfig(4), "intermediate_size = 90"),
    ("v2_greedy_yarn", dict(vocab_size=321), ParallelConfig(2), "vocab_size = 321"),  # unpadded: see below
])
def test_mesh_that_does_not_divide_is_refused(case, overrides, pc, match):
    cfg = cfg_of(case, **overrides)
    with pytest.raises(ValueError, match=match):
        check_rules(cfg, mesh_shape(pc), default_rules(pc))


@pytest.mark.parametrize("vocab,tp,padded", [(321, 2, 384), (611, 4, 768), (320, 2, 0)])
def test_a_vocab_tp_does_not_divide_is_padded_to_64_x_tp(vocab, tp, padded):
    """build_sharding pads such a vocab (ModelSharding.vocab_multiple = 64 x TP) instead of refusing it; a vocab
    that TP divides keeps its shapes."""
    cfg = cfg_of("v2_greedy_yarn", vocab_size=vocab).with_vocab_multiple(1 if vocab % tp == 0 else 64 * tp)
    assert cfg.padded_vocab_size == padded and cfg.vocab_size == vocab
    assert cfg.with_vocab_multiple(1) == cfg  # a padded config stays padded (fit_config of a loaded one)
    check_rules(cfg, mesh_shape(ParallelConfig(tp)), default_rules(ParallelConfig(tp)))
    specs = param_partition_specs(cfg, default_rules(ParallelConfig(tp)))
    assert specs["embed"] == P("tensor", None)


def test_inconsistent_rules_are_refused():
    cfg, pc = cfg_of("v2_greedy_yarn"), ParallelConfig(2, 2, True)
    base = dict(default_rules(pc))

    def rules(**kw):
        return tuple({**base, **kw}.items())

    with pytest.raises(ValueError, match="same mesh"):
        check_rules(cfg, mesh_shape(pc), rules(pages=()))
    with pytest.raises(ValueError, match="one head wide"):
        check_rules(cfg, mesh_shape(pc), rules(kv_latent=("tensor",)))
    with pytest.raises(ValueError, match="share a mesh axis"):
        check_rules(cfg, mesh_shape(pc), rules(heads=DT))
    with pytest.raises(ValueError, match="split two of its dimensions"):
        check_rules(cfg, mesh_shape(pc), rules(moe_mlp=("tensor",)))
    with pytest.raises(ValueError, match="mesh axis 'model'"):
        check_rules(cfg, mesh_shape(pc), rules(heads=("model",)))


def test_too_few_devices_and_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="needs 128 devices"):
        make_mesh(ParallelConfig(64, 2))
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        ParallelConfig(0)
    assert ParallelConfig(2, 4, True).expert_parallel_size == 8 and ParallelConfig(2, 4).expert_parallel_size == 1


def test_llm_refuses_a_mesh_that_does_not_divide_the_heads(hf_case):
    from deepinfer_jax import LLM

    _, path = hf_case("v2_greedy_yarn")
    with pytest.raises(ValueError, match="num_attention_heads = 4 is not divisible by 8"):
        LLM(path, tensor_parallel_size=8, skip_tokenizer_init=True, progress=False)


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(2, 2 + n)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))


def test_dp_scheduler_balances_ranks_and_keeps_pages_local():
    from deepinfer_jax.scheduler import Scheduler

    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    sched = DPScheduler([Scheduler(cfg, CacheConfig(page_size=8), 20) for _ in range(2)])
    for i, n in enumerate([5, 20, 3, 9, 1]):
        sched.add_request(_req(str(i), n))
    assert [sched.rank_of(str(i)) for i in range(5)] == [0, 1, 0, 1, 0]
    plan = sched.schedule()
    # Rank 1's 20-token prompt takes its whole 16-token budget (chunked); rank 0 is not held back.
    assert plan.ranks == [0, 0, 0, 1] and [s.request_id for s in plan.seqs] == ["4", "0", "2", "1"]  # decodes first
    assert [len(s.token_ids) for s in plan.seqs] == [1, 5, 3, 16]
    assert all(1 <= p < 20 for s in plan.seqs for p in s.page_ids)  # local page ids, page 0 is each rank's null
    updates = sched.update_from_output(plan, {s.request_id: 7 for s in plan.seqs if s.sample})
    assert {r.request_id for r, _, _ in updates} == {"0", "2", "4"}  # "1" (20 tokens) is still mid-prefill
    assert sched.abort_request("1") and sched.rank_of("1") is None and not sched.abort_request("1")
    assert sched.stats().num_running == 3 and sched.stats().num_waiting == 1
    assert set(sched.requests) == {"0", "2", "3", "4"} and sched.has_unfinished_requests()


def test_merge_rank_steps_lays_ranks_out_in_blocks():
    from deepinfer_jax.runner.inputs import Shapes, build_metadata, build_sampling
    from deepinfer_jax.scheduler.scheduler import ScheduledSeq

    shapes = Shapes((16,), 4, 4, 8, 32)
    seqs = [[ScheduledSeq("a", [5, 6, 7], 0, [1], True, 0)],
            [ScheduledSeq("b", [8], 4, [3], True, 1), ScheduledSeq("c", [9, 9], 0, [1], False, 0)]]
    reqs = {r: _req(r, 3) for r in "abc"}
    seeds = {r: 0 for r in "abc"}
    metas = [build_metadata(g, shapes, 16) for g in seqs]
    sts = [build_sampling(g, reqs, seeds, shapes, 16, False) for g in seqs]
    meta, st, rids, rows = merge_rank_steps(metas, sts, seqs, 16, shapes.seq_rows(16))
    assert meta.token_ids.shape == (32,) and meta.page_table.shape == (8, 4) and st.temperature.shape == (8,)
    assert list(meta.token_ids[:3]) == [5, 6, 7] and list(meta.token_ids[16:19]) == [8, 9, 9]
    assert list(meta.seq_ids[16:19]) == [0, 1, 1]  # rank-local rows
    assert list(meta.slot_mapping[16:19]) == [3 * 8 + 4, 8, 9]  # rank-local pages
    assert list(meta.logits_indices[:5]) == [2, 0, 0, 0, 16] and meta.logits_indices[5] == 18  # global tokens
    assert rids == ["a", None, None, None, "b", "c", None, None] and rows == [0, 4]
    np.testing.assert_array_equal(meta.page_table[4], [3, 0, 0, 0])
    assert dataclasses.is_dataclass(meta)


def test_int4_experts_split_inside_a_group_are_refused():
    """Splitting an INT4 expert weight along its grouped input axis needs whole groups per device."""
    from jax.sharding import AbstractMesh

    from deepinfer_jax.models.moe import EXPERT_AXES, _check_int4_groups, _leaf_spec
    from deepinfer_jax.models.parallel import MeshRules
    from deepinfer_jax.models.quant import QuantizedWeight

    E, Im, D = 4, 32, 64
    down = lambda groups: QuantizedWeight(np.zeros((E, Im // 2, D), np.uint8), np.zeros((E, groups, D), np.float32),  # noqa: E731
                                          bits=4, group_size=Im // groups, n_out=1)
    for ep, groups, ok in [(False, 1, False), (False, 4, True), (True, 1, True)]:
        pc = ParallelConfig(2, 1, ep)
        mr = MeshRules(AbstractMesh((1, 2), ("data", "tensor")), default_rules(pc))
        leaf = down(groups)
        specs = QuantizedWeight(_leaf_spec(mr, EXPERT_AXES["down"], leaf.q), _leaf_spec(mr, EXPERT_AXES["down"], leaf.scale),
                                bits=4, group_size=leaf.group_size, n_out=1)
        if ok:
            _check_int4_groups(mr, "down", leaf, specs)
        else:
            with pytest.raises(ValueError, match="1 quantization group.*cannot be split over 2 devices"):
                _check_int4_groups(mr, "down", leaf, specs)
