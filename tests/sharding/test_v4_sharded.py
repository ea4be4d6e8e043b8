"""DeepSeek-V4 with its routed experts, its attention's query heads and its shared expert's width over the mesh
(sharding/rules.py v4_rules): greedy tokens of a chunked batch through `LLM` equal the one-device engine's (itself HF transformers' greedy
generate), on the tiny V4 checkpoint (hash-routed and scored MoE layers, swiglu_limit, every attention kind; 4 heads
in 2 output groups) and on the same weights as DeepSeek releases them (FP4 routed experts, FP8 linears;
tests/hf_models_v4.py). One subprocess with 8 fake CPU devices (tests/sharding/run_v4.py) runs every layout:

  float 1x1          the one-device reference
  float 2x1ep        expert parallelism over 2 devices, ragged grouped GEMM per device; the heads over 2 devices,
                     and the shared expert's width (its partial sums in the routed experts' one reduction)
  float 2x1          the experts' intermediate dim over 2 devices (partial down projections summed); the heads and
                     the shared expert's width too
  fp4 3x1ep          the released FP4 experts split by expert over 3 devices, through the quantized grouped
                     GEMM kernels on each device's slice of the stored bytes; 3 does not divide the 2 output groups,
                     so the attention stays whole on every device, and 8 columns a device would cut the shared
                     expert's FP8 blocks of 12, so it stays whole too
  fp8 1x1, 2x1ep     the release with FP8 blocks of [2, 2] (which the heads' and the shared expert's splits keep
                     whole), the attention through the Pallas kernels: the FP8 q_b_proj, o_a_proj and o_b_proj split
                     with the heads, the FP8 shared expert by its width

and each layout's weight bytes on a device equal `deepinfer plan`'s per-device figure."""

from __future__ import annotations

import os

import pytest

from hf_models import hf_greedy
from _runs import REPO, run

RUN_V4 = os.path.join(REPO, "tests", "sharding", "run_v4.py")
EXPERTS_SPLIT = ["('data', 'tensor')", "None", "None", "None"]
# Layer 0's q_b_proj [Rq, H, hd], sinks [H], o_a_proj [g, H*hd/g, r], o_b_proj [g*r, D] with the heads split
HEADS_SPLIT = {"q_b_proj": ["None", "tensor", "None"], "sinks": ["tensor"], "o_a_proj": ["tensor", "None", "None"],
               "o_b_proj": ["tensor", "None"]}
# ... and kept in FP8 (q [N, K], HF's orientation): q_b_proj's and o_a_proj's rows, o_b_proj's columns
FP8_HEADS_SPLIT = {"q_b_proj": ["tensor", "None"], "sinks": ["tensor"], "o_a_proj": ["tensor", "None"],
                   "o_b_proj": ["None", "tensor"]}
FP8_BLOCK = (2, 2)  # divides a device's share of the split FP8 dims (heads x head_dim 48, o_groups x rank 10,
# the shared expert's width 12)
# Layer 0's shared expert on a device, gate_up [D, 2, I] and down [I, D] (FP8: q [2, I, D], [D, I]): I = 24 split
# over TP 2; whole at TP 3 on the release's [8, 12] blocks
SPLIT_SHARED, FP8_SHARED = {"gate_up": [40, 2, 12], "down": [12, 40]}, {"gate_up": [2, 12, 40], "down": [40, 12]}
WHOLE_FP8_SHARED = {"gate_up": [2, 24, 40], "down": [40, 24]}


@pytest.fixture(scope="module")
def fp8_release(v4_release, tmp_path_factory):
    from hf_models_v4 import write_v4_release

    return write_v4_release(v4_release[2], str(tmp_path_factory.mktemp("v4fp8") / "release"), FP8_BLOCK)[0]


@pytest.fixture(scope="module")
def runs(v4_release, fp8_release):
    _, release, floats = v4_release
    args = [f"float={floats}:ragged:1x1,2x1ep,2x1", f"fp4={release}:pallas_interpret:3x1ep",
            f"fp8={fp8_release}:pallas_interpret/pallas_interpret:1x1,2x1ep"]
    return run([RUN_V4, *args])


def test_one_device_run_is_hf_greedy(runs, v4_release):
    model = v4_release[0]
    base = runs["float"]["1x1"]["tokens"]
    assert base == [hf_greedy(model, p, n) for p, n in zip(runs["prompts"], runs["max_tokens"])]


@pytest.mark.parametrize("case,layout", [("float", "2x1ep"), ("float", "2x1"), ("fp4", "3x1ep"), ("fp8", "2x1ep")])
def test_sharded_layouts_give_the_one_device_tokens(runs, case, layout):
    r = runs[case][layout]
    one = runs["fp8" if case == "fp8" else "float"]["1x1"]  # the FP8 [2, 10] release's own weights
    assert r["tokens"] == one["tokens"], (case, layout)
    assert r["compiles_after_warmup"] == 0
    split = ["None", "None", "None", "('data', 'tensor')"] if layout == "2x1" else EXPERTS_SPLIT
    assert r["expert_spec"][: len(split)] == split  # gate_up [E, D, 2, I] (FP4: q [E, 2, I, D / 2])
    if case == "fp4":  # TP 3 does not divide o_groups 2: the attention whole on every device
        assert all(a == "None" for spec in r["head_specs"].values() for a in spec)
    else:
        assert r["head_specs"] == (FP8_HEADS_SPLIT if case == "fp8" else HEADS_SPLIT)
    assert r["shared_shards"] == {"float": SPLIT_SHARED, "fp4": WHOLE_FP8_SHARED, "fp8": FP8_SHARED}[case]


@pytest.mark.parametrize("case,layout", [("float", "1x1"), ("float", "2x1ep"), ("float", "2x1"), ("fp4", "3x1ep"),
                                         ("fp8", "1x1"), ("fp8", "2x1ep")])
def test_plan_weight_bytes_per_device_equal_the_engines(runs, case, layout):
    r = runs[case][layout]
    assert r["plan_weight_bytes"] == r["device_weight_bytes"]
    if layout != "1x1":  # the experts (and heads) split, the rest (and the whole per-group cache) on every device
        one = runs["fp8" if case == "fp8" else "float"]["1x1"]
        assert r["device_weight_bytes"] < one["device_weight_bytes"]
        assert r["device_kv_bytes"] == one["device_kv_bytes"]


@pytest.mark.parametrize("case,layout", [("float", "2x1ep"), ("float", "2x1"), ("fp4", "3x1ep"), ("fp8", "2x1ep")])
def test_collectives_are_the_predicted_ones(runs, v4_release, case, layout):
    """The compiled step programs' collectives are those sharding/comm.py predicts for V4: all-reduces of [T, D]
    over the tensor axis and nothing else, one a layer for the attention where its heads split and one a layer for
    the MoE, the shared expert's partial sums (split or whole) in the routed experts' reduction."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.sharding import ParallelConfig
    from deepinfer_jax.sharding.comm import step_collectives

    r = runs[case][layout]
    tp, dp = (int(x) for x in layout.removesuffix("ep").split("x"))
    cfg = ModelConfig.from_model_dir(v4_release[2])
    want = step_collectives(cfg, ParallelConfig(tp, dp, layout.endswith("ep")), 13, r["seq_rows"], 4)
    assert sorted((k, tuple(d)) for k, d in r["collectives"]) == sorted({(c.kind, c.shape) for c in want})
    layers = cfg.num_hidden_layers
    assert r["all_reduces"] == [sum(c.per_step for c in want)] * len(r["all_reduces"]) == \
        [layers * (1 if case == "fp4" else 2)] * len(r["all_reduces"])


def test_layouts_v4_does_not_have_are_refused_by_flag(v4_release):
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.engine.plan import plan
    from deepinfer_jax.sharding import ParallelConfig, build_sharding

    floats = v4_release[2]
    cfg = ModelConfig.from_model_dir(floats)
    with pytest.raises(ValueError, match="--data-parallel-size above 1 is not supported for deepseek_v4"):
        build_sharding(cfg, ParallelConfig(1, 2, True))
    with pytest.raises(ValueError, match="--pipeline-parallel-size above 1 is not supported for deepseek_v4"):
        plan(floats, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="n_routed_experts = 6 is not divisible by 4"):
        plan(floats, tensor_parallel_size=4, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="--all2all-backend all_to_all is not supported for deepseek_v4"):
        build_sharding(cfg, ParallelConfig(2, 1, True, all2all_backend="all_to_all"))
    # FP8 blocks of [8, 12]: the heads' split would give each device 10 rows of o_a_proj, cutting a block
    with pytest.raises(ValueError, match=r"FP8 weight layers.0.attn.o_a_proj: splitting o_groups = 2 over 2 devices.*"
                                         r"change --tensor-parallel-size"):
        plan(v4_release[1], tensor_parallel_size=2, enable_expert_parallel=True)
