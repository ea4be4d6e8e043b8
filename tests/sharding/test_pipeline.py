"""Pipeline parallelism through `LLM` on 8 fake CPU devices, fp32: HF transformers' greedy tokens under PP4,
PP2 x TP2, PP2 x TP4 and PP2 x DP2 x EP4 on a 5-layer DeepSeek-V3 checkpoint (stages of uneven layers, split as
vLLM splits them: 3 + 2 and 1 + 1 + 2 + 1; the dense layer and the MoE layers in different stages), and PP2 x TP2
on a dense Llama checkpoint through the model registry. The workload (tests/sharding/run_pipeline.py) batches more
requests than max_num_seqs, chunks long prompts, preempts for want of pages and hits the prefix cache. Micro-batches
(runner/micro_batches.py): short prompts on a ladder of buckets under PP2 and PP2 x DP2, whose prefill steps and
steps of prefill and decode rows run split. One subprocess a model or workload (the fake devices must be set before
JAX starts), all at once.
"""

from __future__ import annotations

import os

import pytest

from hf_models import build_hf_model, hf_greedy, save_hf_model
from _runs import REPO, run_all

RUN = os.path.join(REPO, "tests", "sharding", "run_pipeline.py")

V3_LAYOUTS = ["1x1-pp4", "2x1-pp2", "4x1-pp2", "2x2ep-pp2"]  # PP2 alone: the PP2 x TP layouts' stage split
DENSE_LAYOUTS = ["2x1-pp2"]
MICRO_LAYOUTS = ["--micro", "1x1-pp2", "1x2-pp2"]
V3_STAGE_LAYERS = {2: [3, 2], 4: [1, 1, 2, 1]}  # vLLM's get_pp_indices for 5 layers


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_case):
    v3 = build_hf_model("v3_grouped_noaux", num_hidden_layers=5)
    v3_dir = save_hf_model(v3, str(tmp_path_factory.mktemp("v3_5_layers")))
    dense, dense_dir = hf_case("llama_tp")
    out = run_all({name: [RUN, path, *layouts]
                   for name, path, layouts in (("v3", v3_dir, V3_LAYOUTS), ("dense", dense_dir, DENSE_LAYOUTS),
                                               ("micro", v3_dir, MICRO_LAYOUTS))})
    return {"v3": (v3, out["v3"], v3_dir), "dense": (dense, out["dense"], dense_dir),
            "micro": (v3, out["micro"], v3_dir)}


@pytest.mark.parametrize("model", ["v3", "dense", "micro"])
def test_pipeline_greedy_equals_hf(runs, model):
    hf, res, _ = runs[model]
    want = [hf_greedy(hf, p, n) for p, n in zip(res["prompts"], res["max_tokens"])]
    for layout, r in res["layouts"].items():
        assert r["tokens"] == want, layout
        assert r["compiles_after_warmup"] == 0, layout
        assert r["preemptions"] > 0 and r["prefix_hits"] > 0, layout  # the workload did preempt and hit
        assert all(u == 0.0 for u in r["kv_usage_after"]), layout
    print(f"\n{model}: " + ", ".join(f"{k} {r['seconds']}s" for k, r in res["layouts"].items()))


def test_pipeline_stages_hold_their_layers_on_their_own_devices(runs):
    """Each stage's params and KV cache on its own TP x DP devices, its cache holding its layers only, and its
    params' bytes a device what `deepinfer plan` predicts for that stage."""
    from deepinfer_jax.engine.plan import plan

    for model in ("v3", "dense"):
        _, res, path = runs[model]
        for layout, r in res["layouts"].items():
            base, pp = layout.split("-pp")
            pp = int(pp)
            tp, dp = (int(x) for x in base.removesuffix("ep").split("x"))
            if model == "v3":
                assert r["stage_layers"] == V3_STAGE_LAYERS[pp], layout  # each stage's KV cache: its layers only
            n = tp * dp
            assert r["stage_devices"] == [list(range(s * n, (s + 1) * n)) for s in range(pp)], layout
            assert r["memory_devices"] == pp * n, layout  # /metrics' memory report counts every stage's devices
            p = plan(path, dtype="float32", tensor_parallel_size=tp, data_parallel_size=dp,
                     enable_expert_parallel=base.endswith("ep"), pipeline_parallel_size=pp)
            assert list(p.stage_weight_bytes) == r["stage_weight_bytes"], layout


def test_pipeline_steps_run_as_micro_batches(runs):
    """Every stage queues one program a micro-batch of every step (the stage_dispatches counter against the steps'
    micro-batch counts), and the workload did split steps, under DP too: the tokens of those runs are HF's
    (test_pipeline_greedy_equals_hf["micro"]). The logits gather of a split step moves nothing between devices."""
    _, res, _ = runs["micro"]
    for layout, r in res["layouts"].items():
        counts = {int(m): n for m, n in r["micro_batch_counts"].items()}
        assert sum(counts.values()) == r["steps"], layout
        assert r["stage_dispatches"] == [sum(m * n for m, n in counts.items())] * 2, layout
        assert any(m > 1 for m in counts), layout
        assert r["stage_boundary_bytes"] > 0, layout
        assert r["gather_collectives"] == [], layout  # each data rank gathers its own logits rows


def test_pipeline_keeps_a_step_of_each_group_in_flight(runs):
    """Decode overlap (engine/decode_groups.py, runner/pipeline.py): one group of requests a stage, each group's step
    queued while the others' are in flight (their HF tokens: test_pipeline_greedy_equals_hf), every group ran steps;
    stop token ids end requests as they should; one group gives the same tokens; more groups than stages refused."""
    for model in ("v3", "dense", "micro"):
        _, res, _ = runs[model]
        for layout, r in res["layouts"].items():
            pp = int(layout.split("-pp")[1])
            assert r["max_steps_in_flight"] == pp, layout
            assert len(r["group_steps"]) == pp and min(r["group_steps"]) > 0, layout
            assert sum(r["group_steps"]) == r["steps"], layout
            assert bool(r["one_group"]) == (model == "v3" and layout in ("1x1-pp4", "2x2ep-pp2")), layout
            if r["one_group"]:  # the first wave again: with stop token ids, then with one group
                hf, _, _ = runs[model]
                want = [hf_greedy(hf, p, n) for p, n in zip(res["prompts"], res["max_tokens"])]
                # one step at a time: the same tokens (and nothing compiled: test_pipeline_greedy_equals_hf)
                assert r["one_group"]["tokens"] == want[:len(r["one_group"]["tokens"])] == r["tokens"][:8], layout
                # a stop token id ends each request at its first occurrence, found a step after it was sampled
                stopped = [[w[:w.index(w[len(w) // 2]) + 1], "stop"] for w in want[:8]]
                assert r["one_group"]["stopped"] == stopped, layout
                assert r["one_group"]["refused"] == (f"decode groups must be in [1, {pp}] (the pipeline stages; 1 "
                                                     f"with speculative decoding), got {pp + 1}"), layout
