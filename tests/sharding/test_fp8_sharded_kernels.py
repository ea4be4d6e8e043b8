"""FP8 weights under tensor parallelism and under data-parallel attention with expert parallelism go through the FP8
kernels on each device's slice, as on one device: o_proj (row-parallel: its heads' columns split) and the dense MLP
(gate_up column-parallel, down row-parallel) through the block-scaled FP8 GEMM inside shard_map, the routed experts
through the FP8 grouped GEMM; the same leaves as on one device keep the reference (dequantize, dot). Greedy tokens
equal the single-device FP8 kernel run's, and a row-parallel W8A8 projection equals the unsharded kernel to fp32
rounding (a device's K slice holds whole activation groups, so their FP8 scales are the unsharded ones). 8 fake CPU
devices in one subprocess (tests/sharding/run_fp8_kernels.py), Pallas interpret mode, fp32.

The tiny V3 with intermediate sizes 128 / 64 and 16 x 32 blocks: under TP = 2 every split dim is whole blocks, and
32-column blocks are deep enough for the FP8 dots' K steps."""

from __future__ import annotations

import os

import pytest

from hf_models import build_hf_model, fp8_checkpoint, save_hf_model
from _runs import REPO, run

BLOCK = (16, 32)  # rows (out) x columns (in)
D, HDV, I = 64, 4 * 16, 128  # hidden, heads x v_head_dim, the dense MLP's intermediate size


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8kernels")
    path = save_hf_model(build_hf_model("v3_grouped_noaux", intermediate_size=I, moe_intermediate_size=64),
                         str(tmp / "float"))
    d, _ = fp8_checkpoint(path, str(tmp / "fp8"), BLOCK)
    return run([os.path.join(REPO, "tests", "sharding", "run_fp8_kernels.py"), d, "1x1", "2x1", "1x2ep"])


def test_split_fp8_gemm_equals_the_unsharded_kernel_and_follows_the_rule(runs):
    r = runs["numerics"]
    assert r["o_proj"]["split"] == [[None, None, "tensor"], ["tensor"]]  # K (heads x dv) split, partial sums added
    assert r["gate_up"]["split"] == [[None, None, "tensor", None], []]  # N (the intermediate rows) split
    assert r["o_proj"]["error"] < 1e-6 and r["gate_up"]["error"] < 1e-6, r
    # The one device's rule judges each device's GEMM (6 token rows, K = 128 / 2, N = 48), not the whole weight.
    assert r["rule"] == {"one_device": True, "local": [6, 64, 48], "per_device": False}


# The stacked q [L, N, K] each FP8 GEMM call reads (a device's slice inside shard_map): o_proj of the dense and the
# MoE segment (1 and 2 layers), the dense MLP's gate_up (gate and up rows as one [2I, D]) and down.
GEMM_READS = {
    "1x1": [[1, D, HDV], [2, D, HDV], [1, 2 * I, D], [1, D, I]],
    "2x1": [[1, D, HDV // 2], [2, D, HDV // 2], [1, I, D], [1, D, I // 2]],  # heads and I split over TP
    "1x2ep": [[1, D, HDV], [2, D, HDV], [1, 2 * I, D], [1, D, I]],  # whole weights, each rank's own tokens
}


@pytest.mark.parametrize("layout", ["2x1", "1x2ep"])
def test_sharded_fp8_runs_the_kernels_and_equals_one_device(runs, layout):
    r, one = runs[layout], runs["1x1"]
    assert sorted({tuple(q) for q, _ in r["gemm"]}) == sorted(map(tuple, GEMM_READS[layout]))
    assert sorted({tuple(q) for q, _ in one["gemm"]}) == sorted(map(tuple, GEMM_READS["1x1"]))
    assert {act for _, act in r["gemm"] + one["gemm"]} == {"fp8"}  # W8A8 at these decode sizes, as on one device
    assert r["experts"] and {tuple(e) for e in r["experts"] + one["experts"]} == {("fp8", "fp8")}
    # The reference dequantizes what it does on one device (the q / kv projections, the shared experts), never
    # the dense MLP or the routed experts.
    deq = {tuple(s) for s in r["dequantized"]}
    assert deq == {tuple(s) for s in one["dequantized"]}
    assert not deq & {(2, I, D), (D, I), (1, 2, I, D), (1, D, I)} and all(len(s) < 4 for s in deq)
    assert r["tokens"] == one["tokens"]
    assert r["compiles_after_warmup"] == 0


def test_sharded_experts_the_grouped_gemm_does_not_tile_dequantize_one_layer(runs):
    """Where the FP8 grouped GEMM refuses the experts' shapes, a device dequantizes its experts of this layer only, not
    of every layer in the stack (as on one device)."""
    assert runs["expert_fallback"] == {"layer": True, "stack": False}
