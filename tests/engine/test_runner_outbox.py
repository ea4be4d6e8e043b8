"""A step's results reach the host through the step program's resident outbox (runner/model_runner.py):
packed on the device, copied out, unpacked on the host. What arrives must be what the forward computed:
the routed expert ids of every MoE layer (RunnerConfig.collect_routing, the benchmarks' experts-touched
figure), the greedy ids (the argmax of the logits), for a prefill step and the decode step after it,
whose tokens are placeholders for ids the prefill sampled on the device, and the expert load counted on the
device (RunnerConfig.count_expert_load: EPLB's observed load, padding tokens left out)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import RunnerConfig
from deepinfer_jax.models.cache import init_kv_cache
from deepinfer_jax.models.deepseek import forward_paged
from deepinfer_jax.runner.inputs import Shapes
from deepinfer_jax.runner.model_runner import ModelRunner
from deepinfer_jax.scheduler.scheduler import ScheduledSeq
from deepinfer_jax.types import Request, SamplingParams
from deepinfer_jax.weights.loader import load_model
from hf_models import random_prompts

PAGE, PAGES = 8, 40


def _reference(params, cfg, cache, host, prev_ids):
    """The forward on the step's metadata, placeholders replaced by `prev_ids`: (greedy ids of the
    sampling rows, routing [num_moe_layers, T, k], the updated cache)."""
    meta = jax.tree.map(jnp.asarray, host.meta)
    ids = np.asarray(host.meta.token_ids)
    meta = dataclasses.replace(meta, token_ids=jnp.asarray(
        np.where(ids <= -2, np.asarray(prev_ids)[np.maximum(-ids - 2, 0)], ids)))
    logits, cache, routing = forward_paged(params, cfg, cache, meta, moe_impl="ragged", attn_impl="reference",
                                           return_routing=True)
    return np.asarray(jnp.argmax(logits, -1))[host.sample_rows], np.asarray(routing), cache


def test_outbox_carries_the_forwards_routing_and_ids(hf_case):
    model, path = hf_case("v3_grouped_noaux")
    cfg, params = load_model(path, jnp.float32, progress=False)
    shapes = Shapes((16, 64), 4, 8, PAGE, 64)
    rc = RunnerConfig(dtype="float32", attn_impl="reference", moe_impl="ragged", collect_routing=True,
                      count_expert_load=True, warmup_full_variant=False)
    runner = ModelRunner(cfg, params, rc, shapes, PAGES)
    prompts = random_prompts(5, [9, 14, 3], model.config.vocab_size)
    pages = [list(range(1 + 3 * i, 4 + 3 * i)) for i in range(len(prompts))]
    reqs = {f"r{i}": Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=4)) for i, p in enumerate(prompts)}
    seeds = {rid: 0 for rid in reqs}
    cache = init_kv_cache(cfg, PAGES, PAGE, jnp.float32)

    prefill = [ScheduledSeq(f"r{i}", p, 0, pages[i], True, 0) for i, p in enumerate(prompts)]
    host = runner.prepare(prefill, reqs, seeds)
    out = runner.run(host)
    want_ids, want_routing, cache = _reference(params, cfg, cache, host, np.zeros(runner.max_rows, np.int32))
    np.testing.assert_array_equal(out.to_host().token_ids[host.sample_rows], want_ids)
    assert runner.last_routing.shape == want_routing.shape == (
        sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers))), 64, cfg.num_experts_per_tok)
    np.testing.assert_array_equal(np.sort(np.asarray(runner.last_routing), -1), np.sort(want_routing, -1))
    E, n_real = cfg.n_routed_experts, sum(map(len, prompts))  # the bucket's real tokens first, then padding
    want_load = np.stack([np.bincount(r[:n_real].ravel(), minlength=E) for r in want_routing])
    np.testing.assert_array_equal(runner.expert_load(), want_load)

    prev = np.zeros(runner.max_rows, np.int32)
    prev[: len(want_ids)] = want_ids
    decode = [ScheduledSeq(f"r{i}", [-(i + 2)], len(p), pages[i], True, 1) for i, p in enumerate(prompts)]
    host = runner.prepare(decode, reqs, seeds)
    out = runner.run(host)
    want_ids, want_routing, _ = _reference(params, cfg, cache, host, prev)
    np.testing.assert_array_equal(out.to_host().token_ids[host.sample_rows], want_ids)
    assert runner.last_routing.shape == want_routing.shape and want_routing.shape[1] == 16
    np.testing.assert_array_equal(np.sort(np.asarray(runner.last_routing), -1), np.sort(want_routing, -1))
    want_load += np.stack([np.bincount(r[:len(prompts)].ravel(), minlength=E) for r in want_routing])
    np.testing.assert_array_equal(runner.expert_load(), want_load)  # the two steps' counts added on the device
    runner.reset_expert_load()
    assert not runner.expert_load().any()
