"""DeepSeek-V4 with weights in host memory (`cpu_offload_gb`, runner/weight_offload.py) on the tiny release-format
checkpoint (FP8 linears, FP4 routed experts; tests/hf_models_v4.py): the chosen leaves (every routed expert and the
two deepest layers' other weights, FP8 ones among them) load straight into pinned host memory, the device holding
the rest only, during the load and after it; each step copies one layer's weights in at a time (inside that layer's
call); greedy tokens equal HF transformers' on the dequantized weights; `deepinfer plan` counts what the engine
offloads."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hf_models import random_prompts
from load_peak import load_peak
from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.engine.plan import plan

GIB = 2**30
SMALL = dict(skip_tokenizer_init=True, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=13, page_size=4,
             progress=False, token_buckets=(13,), greedy_variant=False, warmup_runs=1)


def _announced(path):
    import jax.numpy as jnp

    from deepinfer_jax.weights.loader import prepare_model

    return prepare_model(path, jnp.float32, progress=False)[1]


def _budget(path) -> tuple[int, list]:
    """(bytes of every routed expert and of layers 2 and 3's other weights, each layer's bytes of them): what
    `choose` takes, exactly, for that budget (experts first, then the deepest layers)."""
    from deepinfer_jax.runner.weight_offload import param_leaves

    leaves = param_leaves(_announced(path).abstract)
    take = [(p, n) for p, n in leaves if p[0] == "layers" and ("experts" in p and "shared" not in p or p[1] >= 2)]
    per_layer = [sum(n for p, n in take if p[1] == i) for i in range(1 + max(p[1] for p, _ in take))]
    return sum(n for _, n in take), per_layer


def _kinds(tree) -> set:
    import jax

    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.fixture(scope="module")
def offloaded(v4_release):
    model, rel, _ = v4_release
    nbytes, per_layer = _budget(rel)
    llm = LLM(rel, dtype="float32", cpu_offload_gb=nbytes / GIB, gpu_memory=0.05, **SMALL)
    return model, rel, nbytes, per_layer, llm


def test_offloaded_v4_greedy_equals_hf_and_streams_one_layer_at_a_time(offloaded, hf_greedy, monkeypatch):
    from deepinfer_jax.models.quant import is_fp8
    from deepinfer_jax.models.quant_fp4 import is_fp4
    from deepinfer_jax.runner.step_programs import program_kind
    from deepinfer_jax.runner.weight_offload import copy_in_bytes, host_bytes

    model, _, nbytes, per_layer, llm = offloaded
    runner = llm.engine.runner
    layers = runner.params["layers"]
    assert all(is_fp4(lp["moe"]["experts"]["gate_up"]) and _kinds(lp["moe"]["experts"]) == {"pinned_host"}
               for lp in layers)
    assert is_fp8(layers[3]["attn"]["q_a_proj"]) and _kinds(layers[3]["attn"]["q_a_proj"]) == {"pinned_host"}
    assert _kinds(layers[1]["attn"]) == _kinds(runner.params["embed"]) == {"device"}
    assert host_bytes(runner.params) == llm.engine.offloaded_weight_bytes == nbytes
    assert llm.engine.memory_report()["weights_host"] == nbytes
    # every program that reads the params moves every offloaded byte a step, one layer's at a time
    pids = [p for p in runner.programs.executables if program_kind(p)[0] != "sampler"]
    assert pids and {copy_in_bytes(runner.trace(p).jaxpr) for p in pids} == {(nbytes, max(per_layer))}
    # lowered for a GPU, each copy to the device is in its layer's function, one function a layer
    hlo = runner.trace(pids[0]).lower(lowering_platforms=("cuda",)).as_text()
    funcs = re.split(r"\n\s*func\.func ", hlo)
    copying = [f for f in funcs if '_xla_buffer_placement = "device"' in f]
    assert len(copying) == len(layers) and all(not f.startswith("public @main") for f in copying)

    prompts = random_prompts(43, [5, 19, 27], model.config.vocab_size)
    n = [7, 6, 9]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in n])
    for p, k, o in zip(prompts, n, outs):
        assert o.outputs[0].token_ids == hf_greedy(model, p, k), f"prompt of {len(p)} tokens"
    assert runner.compiles_after_warmup == 0


def test_offloaded_leaves_load_straight_into_host_memory(v4_release, monkeypatch):
    """The chosen leaves (FP4 experts, FP8 and float weights) go to pinned host memory from the checkpoint: the
    device's peak during the load and its bytes after it are the all-on-device load's less the offloaded bytes
    (loading all on the device, then moving, held every byte), and every array equals the all-on-device load's."""
    import jax

    from deepinfer_jax.runner.weight_offload import LoadFirst, choose, host_bytes, offload, param_leaves, place

    rel = v4_release[1]
    reference, whole = load_peak(monkeypatch, _announced(rel))
    total = sum(n for _, n in param_leaves(reference))
    assert whole == total and _kinds(reference) == {"device"}
    announced = _announced(rel)
    direct, offloaded = offload(announced, _budget(rel)[0] / GIB)
    assert not isinstance(direct, LoadFirst) and offloaded == _budget(rel)[0]
    params, peak = load_peak(monkeypatch, direct)
    assert peak == whole - offloaded
    assert host_bytes(params) == offloaded
    assert sum(x.nbytes for x in jax.tree.leaves(params) if x.sharding.memory_kind == "device") == total - offloaded
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    chosen = set(choose(param_leaves(announced.abstract), offloaded))  # the old way: all on the device, then moved
    old = LoadFirst(direct.abstract, lambda p=_announced(rel): place(p.load(), chosen))
    assert load_peak(monkeypatch, old)[1] >= whole


def test_plan_counts_what_the_engine_offloads(offloaded):
    """`deepinfer plan --cpu-offload-gb` for V4: the engine's offloaded bytes, the most of them a step holds (the
    largest layer's), the weights on the device less them, the KV cache more by them, and the engine's pools."""
    _, rel, nbytes, per_layer, llm = offloaded
    sizes = dict(dtype="float32", gpu_memory_gib=0.05, max_model_len=64, page_size=4, max_num_seqs=4,
                 max_num_batched_tokens=13)
    whole = plan(rel, **sizes)
    p = plan(rel, cpu_offload_gb=nbytes / GIB, **sizes)
    assert p.offloaded_weight_bytes == llm.engine.offloaded_weight_bytes == nbytes
    assert p.offload_window_bytes == max(per_layer) < nbytes
    assert p.weight_bytes_per_device + nbytes == whole.weight_bytes_per_device
    assert p.kv_cache_bytes_per_device == whole.kv_cache_bytes_per_device + nbytes
    assert "in host memory (--cpu-offload-gb), of which a step holds at most" in "\n".join(p.lines())
    # the engine's per-group pools are those the plan makes of the cache the offloaded bytes leave
    assert llm.engine.runner.memory_report()["kv_cache"] == sum(g["pool_bytes"] for g in p.kv_groups)
