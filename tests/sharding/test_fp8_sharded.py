"""An FP8 block-scaled checkpoint keeps its weights FP8 under tensor parallelism and under data-parallel attention
with expert parallelism: q and its block scales split alike, the greedy tokens of a mixed batch equal to the
unsharded FP8 engine's, every device's weight bytes what `deepinfer plan` says; a layout that would cut a scale
block is refused by the loader and by the plan with one message naming the dimension and the flag. 8 fake CPU
devices in one subprocess (tests/sharding/run_fp8.py), ragged experts and the reference attention, fp32.

The tiny V3 (q-LoRA, a dense layer, routed and shared experts) with 16 x 8 blocks: under TP = 2 every device's
share of the split dims (heads x head dims, the dense, shared and routed intermediate dims) is whole blocks;
under TP = 4 one head's 24 q_b_proj rows are not."""

from __future__ import annotations

import os

import pytest

from hf_models import fp8_checkpoint
from _runs import REPO, run

BLOCK = (16, 8)  # rows (out) x columns (in)
LAYOUTS = ["1x1", "2x1", "1x2ep", "4x1", "2x2"]


@pytest.fixture(scope="module")
def runs(hf_case, tmp_path_factory):
    _, path = hf_case("v3_grouped_noaux")
    d, _ = fp8_checkpoint(path, str(tmp_path_factory.mktemp("fp8tp") / "fp8"), BLOCK)
    return run([os.path.join(REPO, "tests", "sharding", "run_fp8.py"), d, *LAYOUTS])


@pytest.mark.parametrize("layout", ["2x1", "1x2ep"])
def test_fp8_sharded_greedy_equals_unsharded(runs, layout):
    r, base = runs[layout], runs["1x1"]
    assert r["tokens"] == base["tokens"], layout
    assert r["compiles_after_warmup"] == 0
    # Kept as FP8, not dequantized: the 5 MLA projections of both segments, the dense MLP's 2, the routed and the
    # shared experts' 2 each.
    assert r["fp8_leaves"] == 5 + 2 + 5 + 2 + 2 and r["q_dtypes"] == ["float8_e4m3fn"]
    assert r["allocated_bytes"] == r["planned_bytes"]


def test_fp8_partitions_follow_the_float_layout(runs):
    """q and scale alike: [L, N, K] with N the heads' rows or the intermediate dim, K o_proj's heads."""
    tp, ep = runs["2x1"]["specs"], runs["1x2ep"]["specs"]
    moe = ["data", "tensor"]  # the experts' mesh axes (rules.py)
    for specs in (tp, ep):
        for name, (q, scale) in specs.items():
            assert q == scale, name
    assert tp["q_b_proj"][0] == [None, "tensor", None]  # q_b rows H x dqk: the heads
    assert tp["o_proj"][0] == [None, None, "tensor"]  # o_proj columns H x dv: the heads
    assert tp["shared_gate_up"][0] == [None, None, "tensor", None]  # [L, 2, I, D]: the shared experts' I
    assert tp["experts_gate_up"][0] == [None, None, None, moe, None]  # [L, E, 2, I, D]: the experts' I
    assert tp["experts_down"][0] == [None, None, None, moe]  # [L, E, D, I]
    assert ep["experts_gate_up"][0] == [None, moe, None, None, None]  # the expert axis
    assert ep["experts_down"][0] == [None, moe, None, None]


def test_a_split_inside_a_scale_block_is_refused(runs):
    r = runs["4x1"]
    want = ("FP8 weight segments.0.attn.q_b_proj: splitting num_attention_heads = 4 over 4 devices gives each device "
            "24 of its 96 output rows, not a multiple of the weight_block_size [16, 8] (a scale block would straddle "
            "two devices); change --tensor-parallel-size, or load the weights in float (--quantization none)")
    assert r["refused"] == want and r["plan_refused"] == want
    # DP = 2 x TP = 2 without expert parallelism: the routed experts' 32 rows over 4 devices.
    r = runs["2x2"]
    assert r["refused"] == r["plan_refused"] and r["refused"].startswith(
        "FP8 weight segments.1.moe.experts.gate_up: splitting moe_intermediate_size = 32 over 4 devices gives each "
        "device 8 of its 32 output rows"), r
    assert "--enable-expert-parallel" in r["refused"]
