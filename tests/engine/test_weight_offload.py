"""Weights in host memory (`cpu_offload_gb`, runner/weight_offload.py): greedy tokens equal HF transformers' (float)
and the all-on-device engine's (INT8) with the routed experts in pinned host memory; the chosen leaves really
there; the step programs copy them in one layer at a time; the KV cache sized with them free, as `deepinfer plan`
says; the refusals."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hf_models import random_prompts
from load_peak import load_peak
from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.config import CacheConfig
from deepinfer_jax.engine.plan import plan
from deepinfer_jax.runner.weight_offload import choose, copy_in_bytes, host_bytes, step_window

GIB = 2**30
# one token bucket, no greedy or context variants: three programs an engine
SMALL = dict(skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, page_size=8,
             progress=False, token_buckets=(64,), greedy_variant=False, prefill_context_variant=False)


def _experts_bytes(path, dtype) -> int:
    """Bytes of the routed experts' leaves of the checkpoint at `path` (its announced params)."""
    import jax.numpy as jnp

    from deepinfer_jax.runner.weight_offload import param_leaves
    from deepinfer_jax.weights.loader import prepare_model

    abstract = prepare_model(path, jnp.dtype(dtype), progress=False)[1].abstract
    return sum(n for p, n in param_leaves(abstract) if "experts" in p)


def _memory_kinds(tree) -> set:
    import jax

    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def test_choose_order():
    """Routed experts first, the deepest layers first (MTP deepest), the largest first; never over the budget."""
    leaves = [(("embed",), 50), (("segments", 0, "mlp", "down"), 10), (("segments", 1, "moe", "experts", "down"), 30),
              (("segments", 1, "moe", "experts", "gate_up"), 60), (("segments", 2, "moe", "experts", "down"), 30),
              (("mtp", 0, "layer", "moe", "experts", "down"), 5), (("segments", 2, "attn", "o_proj"), 8),
              (("segments", 1, "moe", "shared", "down"), 4)]
    assert choose(leaves, 94) == [("mtp", 0, "layer", "moe", "experts", "down"),
                                  ("segments", 2, "moe", "experts", "down"),
                                  ("segments", 1, "moe", "experts", "down"),  # gate_up (60) does not fit in the 59 left
                                  ("segments", 2, "attn", "o_proj"), ("segments", 1, "moe", "shared", "down"),
                                  ("segments", 0, "mlp", "down")]
    assert choose(leaves, 4) == [("segments", 1, "moe", "shared", "down")]
    assert choose(leaves, 0) == []


@pytest.fixture(scope="module")
def offloaded(hf_case):
    """A float32 engine of the V3 case with its routed experts' bytes offloaded, on a device of 0.05 GiB."""
    model, path = hf_case("v3_grouped_noaux")
    gib = _experts_bytes(path, "float32") / GIB
    llm = LLM(path, dtype="float32", cpu_offload_gb=gib, gpu_memory=0.05, **SMALL)
    return model, path, gib, llm


def test_offloaded_greedy_equals_hf(offloaded, hf_greedy):
    model, path, gib, llm = offloaded
    params = llm.engine.runner.params
    experts = [seg["moe"]["experts"] for seg in params["segments"] if "moe" in seg]
    assert experts and all(_memory_kinds(e) == {"pinned_host"} for e in experts)
    others = [seg if "moe" not in seg else {**seg, "moe": {k: v for k, v in seg["moe"].items() if k != "experts"}}
              for seg in params["segments"]]
    assert _memory_kinds([others, params["embed"], params["lm_head"]]) == {"device"}
    assert llm.engine.offloaded_weight_bytes == int(gib * GIB)
    prompts = random_prompts(7, [5, 19, 33], model.config.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model, p, 6)
    # prompt logprobs (runner/prompt_scoring.py) read the offloaded params too
    lp = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert lp[0].prompt_logprobs is not None and len(lp[0].prompt_logprobs) == len(prompts[0])
    assert llm.engine.runner.compiles_after_warmup == 0
    report = llm.engine.memory_report()
    assert report["weights_host"] == llm.engine.offloaded_weight_bytes


def _layer_share(experts) -> int:
    """Bytes of one layer's slices of the stacked routed experts `experts` (each leaf [L, ...])."""
    import jax

    layers = {a.shape[0] for a in jax.tree.leaves(experts)}
    assert len(layers) == 1 and layers.pop() > 1  # several layers a leaf: a whole leaf is more than one layer
    return host_bytes(experts) // jax.tree.leaves(experts)[0].shape[0]


def _step_copies(runner) -> set:
    """copy_in_bytes of every program of `runner` that reads the params (not the samplers)."""
    from deepinfer_jax.runner.step_programs import program_kind

    return {copy_in_bytes(runner.trace(pid).jaxpr) for pid in runner.programs.executables
            if program_kind(pid)[0] != "sampler"}


def test_steps_stream_one_layer_at_a_time(offloaded):
    """A step holds one MoE layer's slice of the offloaded experts on the device at once, not the segment's (the
    whole-leaf copy held all of them), and still moves every offloaded byte. Lowered for a GPU, each copy to the
    device (XLA's annotation) is of one layer's [E, ...] slice, inside the layer loop."""
    _, _, _, llm = offloaded
    runner = llm.engine.runner
    experts = [seg["moe"]["experts"] for seg in runner.params["segments"] if "moe" in seg]
    moved = host_bytes(runner.params)
    assert moved == llm.engine.offloaded_weight_bytes
    window = max(map(_layer_share, experts))
    assert window < moved
    assert _step_copies(runner) == {(moved, window)}
    pid = next(p for p in runner.programs.executables if p[0] == "forward")
    hlo = runner.trace(pid).lower(lowering_platforms=("cuda",)).as_text()
    copied = re.findall(r'annotate_device_placement.*_xla_buffer_placement = "device".*: \(tensor<([0-9x]+)x\w+>\)',
                        hlo)
    import jax

    slices = sorted("x".join(map(str, a.shape[1:])) for e in experts for a in jax.tree.leaves(e))
    assert sorted(copied) == slices
    body = hlo[hlo.index("stablehlo.while"):]  # the layer loop's copies are in its body
    assert len(re.findall(r'_xla_buffer_placement = "device"', body)) == len(slices)


def test_copy_in_bytes():
    """The measure on small programs: a whole stacked copy holds all of it, a scan copying its layer's slice holds
    one slice and moves all; a copy nothing reads (jit drops it) counts for nothing."""
    import jax
    import jax.numpy as jnp

    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    w = jax.device_put(jnp.ones((3, 8, 8), jnp.float32), host)
    x = jnp.ones((2, 8), jnp.float32)
    on_device = lambda a: jax.device_put(a, jax.memory.Space.Device)  # noqa: E731

    def whole(w, x):
        return jax.lax.scan(lambda h, lw: (jnp.tanh(h @ lw), None), x, on_device(w))[0]

    def streamed(w, x):
        return jax.lax.scan(lambda h, lw: (jnp.tanh(h @ on_device(lw)), None), x, w)[0]

    def unused(w, x):
        on_device(w)
        return x

    layer = 8 * 8 * 4  # one [8, 8] float32 slice
    assert copy_in_bytes(jax.jit(whole).trace(w, x).jaxpr) == (3 * layer, 3 * layer)
    assert copy_in_bytes(jax.jit(streamed).trace(w, x).jaxpr) == (3 * layer, layer)
    assert copy_in_bytes(jax.jit(unused).trace(w, x).jaxpr) == (0, 0)


def test_step_window():
    """`deepinfer plan`'s figure: one layer's share of each chosen segment leaf, the largest segment's, plus the
    chosen leaves outside the segments whole (DeepSeek-V4: each of its layers a segment of one layer); every chosen
    byte for a family that does not stream."""
    chosen = [(("segments", 1, "moe", "experts", "down"), 30), (("segments", 1, "moe", "experts", "gate_up"), 60),
              (("segments", 2, "moe", "experts", "down"), 40), (("mtp", 0, "layer", "moe", "experts", "down"), 5)]
    assert step_window(chosen, [1, 3, 2], "deepseek") == 5 + max(30 // 3 + 60 // 3, 40 // 2)
    assert step_window(chosen, [1, 3, 2], "other") == 135  # (a family that does not stream: none today)
    assert step_window([], [1, 3], "deepseek") == 0
    v4 = [(("layers", 3, "moe", "experts", "down"), 30), (("layers", 3, "moe", "experts", "gate_up"), 60),
          (("layers", 2, "moe", "experts", "down"), 40), (("layers", 2, "attn", "q_b_proj"), 70),
          (("mtp", 0, "layer", "moe", "experts", "down"), 5), (("lm_head",), 7)]
    assert step_window(v4, [], "deepseek_v4") == 5 + 7 + max(30 + 60, 40 + 70)


def test_choose_order_v4():
    """DeepSeek-V4's layers (one dict a layer) in the same order: routed experts first, the deepest layer first."""
    leaves = [(("embed",), 50), (("layers", 0, "moe", "experts", "down"), 30), (("layers", 1, "attn", "wo"), 8),
              (("layers", 1, "moe", "experts", "down"), 20), (("layers", 1, "moe", "shared", "down"), 4),
              (("layers", 0, "attn", "wo"), 9)]
    assert choose(leaves, 62) == [("layers", 1, "moe", "experts", "down"), ("layers", 0, "moe", "experts", "down"),
                                  ("layers", 1, "attn", "wo"), ("layers", 1, "moe", "shared", "down")]


def test_plan_counts_what_the_engine_offloads(offloaded):
    """The KV cache grows by the offloaded bytes, exactly as `deepinfer plan` says; the host tier is counted."""
    from deepinfer_jax.models.cache import kv_cache_bytes_per_page

    _, path, gib, llm = offloaded
    whole = plan(path, dtype="float32", gpu_memory_gib=0.05, max_model_len=128)
    p = plan(path, dtype="float32", gpu_memory_gib=0.05, max_model_len=128, cpu_offload_gb=gib, kv_offloading_size=0.01)
    assert p.offloaded_weight_bytes == llm.engine.offloaded_weight_bytes > 0
    experts = [seg["moe"]["experts"] for seg in llm.engine.runner.params["segments"] if "moe" in seg]
    assert p.offload_window_bytes == max(map(_layer_share, experts)) < p.offloaded_weight_bytes
    assert p.weight_bytes_per_device + p.offloaded_weight_bytes == whole.weight_bytes_per_device
    assert p.kv_cache_bytes_per_device == whole.kv_cache_bytes_per_device + p.offloaded_weight_bytes
    per_page = kv_cache_bytes_per_page(llm.model_config, 8, "float32")
    assert llm.engine.runner.num_pages == p.kv_cache_bytes_per_device // per_page
    assert p.kv_host_tier_tokens == (int(0.01 * GIB) // (per_page * 8)) * 64 and p.kv_host_tier_bytes > 0
    text = "\n".join(p.lines())
    assert "in host memory (--cpu-offload-gb), of which a step holds at most" in text and "KV host tier" in text


def _greedy_reference(params, cfg, prompt, n):
    """Greedy tokens of the dense forward (runner/prompt_scoring.py's program) on `params`, all on the device."""
    from deepinfer_jax.runner.prompt_scoring import PromptScorer

    scorer, ids = PromptScorer(cfg, 1, "ragged"), list(prompt)
    for _ in range(n):  # position len(ids) - 1 predicts the next token (the appended 0 is only its target)
        ids.append(int(scorer.score(params, ids + [0])[2][len(ids) - 1, 0]))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def int8_case(hf_case, tmp_path_factory):
    """(HF model, the V3 case converted to INT8)."""
    from deepinfer_jax.weights.convert import convert

    model, src = hf_case("v3_grouped_noaux")
    dst = str(tmp_path_factory.mktemp("int8") / "ckpt")
    convert(src, dst, "float32", "int8", progress=False)
    return model, dst


def test_int8_offloaded_equals_on_device(int8_case):
    """INT8 leaves (q and scale) offloaded, the steps as one program each (no shared forward): the greedy tokens of
    the model with every weight on the device."""
    import jax.numpy as jnp

    from deepinfer_jax.weights.loader import load_model

    model, dst = int8_case
    prompts = random_prompts(3, [6, 9], model.config.vocab_size)  # with 5 more tokens: one scoring bucket
    llm = LLM(dst, cpu_offload_gb=_experts_bytes(dst, "float32") / GIB, prefill_shared_forward=False, **SMALL)
    experts = [seg["moe"]["experts"] for seg in llm.engine.runner.params["segments"] if "moe" in seg]
    assert all(_memory_kinds(e["gate_up"]) == {"pinned_host"} and e["gate_up"].q.dtype == np.int8 for e in experts)
    # q and scale stream together, one layer's slices at a time
    assert _step_copies(llm.engine.runner) == {(host_bytes(llm.engine.runner.params), max(map(_layer_share, experts)))}
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    cfg, params = load_model(dst, jnp.float32, progress=False)
    assert _memory_kinds(params) == {"device"}
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _greedy_reference(params, cfg, p, 5)
    assert llm.engine.runner.compiles_after_warmup == 0


def test_dense_family_streams_one_layer_at_a_time(hf_case, hf_greedy):
    """A Llama model with its MLP weights in host memory: each step copies one layer's slices of them in inside the
    layer loop (the dense forward's `layer_fetch`, models/deepseek.py `run_layers`), and the greedy tokens are HF
    transformers'."""
    import jax.numpy as jnp

    from deepinfer_jax.runner.weight_offload import param_leaves
    from deepinfer_jax.weights.loader import prepare_model

    model, path = hf_case("llama_llama3")
    abstract = prepare_model(path, jnp.float32, progress=False)[1].abstract
    llm = LLM(path, dtype="float32", cpu_offload_gb=sum(n for p, n in param_leaves(abstract) if "mlp" in p) / GIB,
              **SMALL)
    runner = llm.engine.runner
    assert _memory_kinds(runner.params["segments"][0]["mlp"]) == {"pinned_host"}
    moved = host_bytes(runner.params)
    assert moved == llm.engine.offloaded_weight_bytes == host_bytes(runner.params["segments"])
    assert _step_copies(runner) == {(moved, moved // model.config.num_hidden_layers)}
    prompts = random_prompts(8, [4, 21], model.config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model, p, 5)
    assert runner.compiles_after_warmup == 0


@pytest.mark.parametrize("kind", ["float", "fp8", "int8"])
def test_offloaded_leaves_load_straight_into_host_memory(kind, hf_case, int8_case, monkeypatch):
    """The load places the chosen leaves in pinned host memory straight from the checkpoint: the most the device
    holds while it loads is the all-on-device load's less the offloaded bytes (moving them after the load held all
    of them), and every array equals the all-on-device load's. HF float32 and online FP8 (Fp8Weight q and scale) loaded in
    place on the device (as on a GPU, not assembled in numpy), and a converted INT8 checkpoint (orbax)."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.runner.weight_offload import LoadFirst, offload, param_leaves, place
    from deepinfer_jax.weights import hf_loader
    from deepinfer_jax.weights.loader import prepare_model

    monkeypatch.setattr(hf_loader, "HOST_ASSEMBLY_BYTES", 0)
    path = int8_case[1] if kind == "int8" else hf_case("v3_grouped_noaux")[1]
    quant = "fp8" if kind == "fp8" else None

    def pending():
        return prepare_model(path, jnp.float32, progress=False, quantization=quant)[1]

    reference, whole = load_peak(monkeypatch, pending())
    total = sum(n for _, n in param_leaves(reference))
    assert whole >= total
    announced = pending()
    experts = sum(n for p, n in param_leaves(announced.abstract) if "experts" in p)
    direct, offloaded = offload(announced, experts / GIB)
    assert not isinstance(direct, LoadFirst) and 0 < offloaded < total
    params, peak = load_peak(monkeypatch, direct)
    assert 0 < peak <= whole - offloaded  # (a converted unit's resident slices are restored, then stacked)
    assert host_bytes(params) == offloaded
    fp8 = [x for x in jax.tree.leaves(params, is_leaf=lambda x: hasattr(x, "block")) if hasattr(x, "block")]
    assert (kind == "fp8") == bool(fp8)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    if kind == "float":  # the check fails for the old way: the whole model on the device, then the move
        chosen = set(choose(param_leaves(announced.abstract), offloaded))  # offload's choice
        old = LoadFirst(direct.abstract, lambda p=pending(): place(p.load(), chosen))
        assert load_peak(monkeypatch, old)[1] >= whole


def test_random_weights_offloaded_equal_on_device(hf_case):
    """Random weights (load_format "dummy") with an MLP weight in host memory: drawn there one leaf at a time
    (programs whose output is in host memory), the same values as every weight drawn on the device. (A Llama
    model: few leaves, so the draws compile fast.)"""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.runner.weight_offload import LoadFirst, offload, param_leaves
    from deepinfer_jax.weights.random_init import pending_random_params

    cfg = ModelConfig.from_model_dir(hf_case("llama_llama3")[1])
    reference = pending_random_params(cfg, jnp.float32, seed=3).result()
    announced = pending_random_params(cfg, jnp.float32, seed=3)
    gate_up = dict(param_leaves(announced.abstract))[("segments", 0, "mlp", "gate_up")]  # the largest leaf
    direct, offloaded = offload(announced, gate_up / GIB)
    assert not isinstance(direct, LoadFirst) and offloaded == gate_up
    params = direct.result()
    assert host_bytes(params) == offloaded
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_refusals(hf_case):
    from deepinfer_jax.runner.weight_offload import offload

    _, path = hf_case("v3_grouped_noaux")
    with pytest.raises(ValueError, match="cpu_offload_gb 1 GiB exceeds the model's weights"):
        plan(path, dtype="float32", cpu_offload_gb=1.0)
    with pytest.raises(ValueError, match="cpu_offload_gb is not supported with tensor"):
        plan(path, dtype="float32", cpu_offload_gb=0.001, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="cpu_offload_gb is not supported with tensor"):
        offload({}, 1.0, sharding=object())
    with pytest.raises(ValueError, match="cpu_offload_gb must be >= 0"):
        CacheConfig(cpu_offload_gb=-1.0)
    with pytest.raises(ValueError, match="exceeds the model's weights"):
        LLM(path, dtype="float32", cpu_offload_gb=1.0, **SMALL)
