"""DeepSeek-V4 with its routed experts over the mesh (sharding/rules.py v4_rules): greedy tokens of a chunked batch
through `LLM` equal the one-device engine's (itself HF transformers' greedy generate), on the tiny V4 checkpoint
(hash-routed and scored MoE layers, swiglu_limit, every attention kind) and on the same weights as DeepSeek releases
them (FP4 routed experts, FP8 linears; tests/hf_models_v4.py). One subprocess with 8 fake CPU devices
(tests/sharding/run_v4.py) runs every layout:

  float 1x1          the one-device reference
  float 2x1ep        expert parallelism over 2 devices, ragged grouped GEMM per device
  float 2x1          the experts' intermediate dim over 2 devices (partial down projections summed)
  fp4 3x1ep          the released FP4 experts split by expert over 3 devices, through the quantized grouped
                     GEMM kernels on each device's slice of the stored bytes

and each layout's weight bytes on a device equal `deepinfer plan`'s per-device figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hf_models import hf_greedy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_V4 = os.path.join(REPO, "tests", "sharding", "run_v4.py")
EXPERTS_SPLIT = ["('data', 'tensor')", "None", "None", "None"]


@pytest.fixture(scope="module")
def runs(v4_release):
    _, release, floats = v4_release
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    args = [f"float={floats}:ragged:1x1,2x1ep,2x1", f"fp4={release}:pallas_interpret:3x1ep"]
    p = subprocess.run([sys.executable, RUN_V4, *args], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0 and "RESULT " in p.stdout, p.stderr[-4000:]
    return json.loads(p.stdout.split("RESULT ", 1)[1])


def test_one_device_run_is_hf_greedy(runs, v4_release):
    model = v4_release[0]
    base = runs["float"]["1x1"]["tokens"]
    assert base == [hf_greedy(model, p, n) for p, n in zip(runs["prompts"], runs["max_tokens"])]


@pytest.mark.parametrize("case,layout", [("float", "2x1ep"), ("float", "2x1"), ("fp4", "3x1ep")])
def test_sharded_experts_give_the_one_device_tokens(runs, case, layout):
    r = runs[case][layout]
    assert r["tokens"] == runs["float"]["1x1"]["tokens"], (case, layout)
    assert r["compiles_after_warmup"] == 0
    split = ["None", "None", "None", "('data', 'tensor')"] if layout == "2x1" else EXPERTS_SPLIT
    assert r["expert_spec"][: len(split)] == split  # gate_up [E, D, 2, I] (FP4: q [E, 2, I, D / 2])


@pytest.mark.parametrize("case,layout", [("float", "1x1"), ("float", "2x1ep"), ("float", "2x1"), ("fp4", "3x1ep")])
def test_plan_weight_bytes_per_device_equal_the_engines(runs, case, layout):
    r = runs[case][layout]
    assert r["plan_weight_bytes"] == r["device_weight_bytes"]
    if layout != "1x1":  # the experts split, the rest (and the whole per-group cache) on every device
        assert r["device_weight_bytes"] < runs["float"]["1x1"]["device_weight_bytes"]
        assert r["device_kv_bytes"] == runs["float"]["1x1"]["device_kv_bytes"]


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
