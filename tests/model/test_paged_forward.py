"""The engine's paged forward: chunked prefill then token-by-token decode equals one full forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.cache import StepMetadata, init_kv_cache
from deepinfer_jax.models.deepseek import forward, forward_paged
from deepinfer_jax.models.params import layer_segments
from deepinfer_jax.weights.hf_loader import load_hf_checkpoint

from paged_steps import PAGE, step as _step


def test_prefill_chunks_then_decode_equal_full_forward(hf_case, case_name):
    _, path = hf_case(case_name)
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, cfg.vocab_size, (3, 40))
    full = np.asarray(forward(params, cfg, jnp.asarray(ids, jnp.int32)))
    # Non-contiguous, interleaved pages; page 0 is never used by a sequence.
    pages = [[5, 2, 9, 14, 20], [3, 11, 7, 1, 18], [6, 4, 13, 17, 8]]
    cache = init_kv_cache(cfg, 24, PAGE, jnp.float32)
    fwd = jax.jit(lambda p, c, m: forward_paged(p, cfg, c, m))  # a program a step size, as the runner's
    # Step 1: chunks of different lengths, one of them a single token; padded batch.
    logits, cache = _step(params, cfg, cache, ids, pages, [(0, 17), (0, 1), (0, 9)], pad_to=32, fwd=fwd)
    np.testing.assert_allclose(np.asarray(logits), full[[0, 1, 2], [16, 0, 8]], atol=2e-5)
    # Step 2: second prefill chunks mixed with a decode.
    logits, cache = _step(params, cfg, cache, ids, pages, [(17, 12), (1, 1), (9, 20)], fwd=fwd)
    np.testing.assert_allclose(np.asarray(logits), full[[0, 1, 2], [28, 1, 28]], atol=2e-5)
    # Decode steps (one program for the six).
    for t in range(6):
        logits, cache = _step(params, cfg, cache, ids, pages, [(29 + t, 1), (2 + t, 1), (29 + t, 1)], pad_to=8,
                              fwd=fwd)
        np.testing.assert_allclose(np.asarray(logits), full[[0, 1, 2], [29 + t, 2 + t, 29 + t]], atol=2e-5)


@pytest.mark.parametrize("prefill_attention,min_queries", [("expanded", 8), ("expanded", 1000), ("absorbed", 8)])
def test_pallas_attention_kernels_equal_full_forward(hf_case, prefill_attention, min_queries, monkeypatch):
    """attn_impl="pallas_interpret": steps with more token slots than sequence rows run the prefill
    path (chunks over cached prefixes, decode tokens, padding): split into each chunk in the expanded
    form plus its cached context (kernels/mla_chunk.py; runs of min_queries+ tokens take their context in the
    expanded form too, kernels/mla_context.py), or all absorbed (kernels/mla_prefill.py); the
    unpadded decode step runs the decode kernel; all give the full forward's logits."""
    from deepinfer_jax.models import deepseek, mla_split

    monkeypatch.setattr(mla_split, "CONTEXT_MIN_QUERIES", min_queries)

    _, path = hf_case("v2_greedy_yarn")
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (3, 40))
    full = np.asarray(forward(params, cfg, jnp.asarray(ids, jnp.int32)))
    pages = [[5, 2, 9, 14, 20], [3, 11, 7, 1, 18], [6, 4, 13, 17, 8]]
    cache = init_kv_cache(cfg, 24, PAGE, jnp.float32)
    splits = []
    plan = deepseek.chunk_split_plan
    contexts = []

    def spy(*a):
        out = plan(*a)
        splits.append(out is not None)
        contexts.append(out is not None and out[4] is not None)
        return out

    monkeypatch.setattr(deepseek, "chunk_split_plan", spy)
    for chunks, pad_to, rows in [([(0, 17), (0, 1), (0, 9)], 32, [16, 0, 8]),
                                 ([(17, 12), (1, 1), (9, 20)], None, [28, 1, 28]),
                                 ([(29, 1), (2, 1), (29, 1)], None, [29, 2, 29])]:  # T == S: the decode kernel
        logits, cache = _step(params, cfg, cache, ids, pages, chunks, pad_to, attn_impl="pallas_interpret",
                              prefill_attention=prefill_attention)
        np.testing.assert_allclose(np.asarray(logits), full[[0, 1, 2], rows], atol=2e-5)
    assert splits == ([False] * 3 if prefill_attention == "absorbed" else [True, True, False])
    assert contexts == ([True, True, False] if prefill_attention == "expanded" and min_queries == 8 else [False] * 3)


def test_paged_forward_under_jit_with_donation(hf_case):
    _, path = hf_case("v2_greedy_yarn")
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 12))
    full = np.asarray(forward(params, cfg, jnp.asarray(ids, jnp.int32)))
    step = jax.jit(lambda p, c, m: forward_paged(p, cfg, c, m), donate_argnums=1)
    cache = init_kv_cache(cfg, 4, PAGE, jnp.float32)
    pages = [[1, 2]]
    meta_fn = lambda s, n: _meta(ids, pages, s, n)  # noqa: E731
    logits, cache = step(params, cache, meta_fn(0, 11))
    np.testing.assert_allclose(np.asarray(logits)[0], full[0, 10], atol=2e-5)
    logits, cache = step(params, cache, meta_fn(11, 1))
    np.testing.assert_allclose(np.asarray(logits)[0], full[0, 11], atol=2e-5)


def _meta(ids, pages, start, n, width=16):
    tid = np.zeros(width, np.int32)
    pos = np.zeros(width, np.int32)
    slot = (np.arange(width) % PAGE).astype(np.int32)  # padding -> null page
    for i, p in enumerate(range(start, start + n)):
        tid[i], pos[i], slot[i] = ids[0][p], p, pages[0][p // PAGE] * PAGE + p % PAGE
    table = np.zeros((1, 4), np.int32)
    table[0, : len(pages[0])] = pages[0]
    return StepMetadata(
        jnp.asarray(tid), jnp.asarray(pos), jnp.zeros(width, jnp.int32), jnp.asarray(slot),
        jnp.asarray(table), jnp.asarray([n - 1], jnp.int32),
    )


def test_quantized_experts_through_the_kernel(hf_case):
    """Stacked INT8 experts go through the Pallas kernel (interpret mode) one layer at a time and give
    the same logits as the XLA ragged path."""
    from deepinfer_jax.models.quant import quantize_params

    _, path = hf_case("v3_grouped_noaux")
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    qp = quantize_params(params, "int8", group_size=16)
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, (1, 10))
    out = {}
    for impl in ("ragged", "pallas_interpret"):
        cache = init_kv_cache(cfg, 4, PAGE, jnp.float32)
        logits, _ = jax.jit(lambda p, c, m, impl=impl: forward_paged(p, cfg, c, m, moe_impl=impl))(
            qp, cache, _meta(ids, [[1, 2]], 0, 10))
        out[impl] = np.asarray(logits)
    np.testing.assert_allclose(out["pallas_interpret"], out["ragged"], atol=2e-5)


def test_unrolled_layers_equal_scanned(hf_case):
    """RunnerConfig.unroll_max_tokens runs small steps with the layer scan unrolled: same logits and cache."""
    from deepinfer_jax.config import RunnerConfig

    _, path = hf_case("v3_grouped_noaux")
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, (1, 12))
    meta = _meta(ids, [[1, 2]], 0, 12)
    outs = []
    for unroll in (1, True, "indexed"):
        cache = init_kv_cache(cfg, 4, PAGE, jnp.float32)
        outs.append(jax.jit(lambda p, c, m, u=unroll: forward_paged(p, cfg, c, m, unroll=u, return_routing=True))(
            params, cache, meta))
    for out in outs[1:]:
        np.testing.assert_allclose(np.asarray(out[0]), np.asarray(outs[0][0]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(out[1]), np.asarray(outs[0][1]), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(outs[0][2]))  # the routed experts
    rc = RunnerConfig()
    assert rc.unroll_for(256, "gpu") and not rc.unroll_for(512, "gpu") and not rc.unroll_for(16, "cpu")
    assert RunnerConfig(unroll_max_tokens=64).unroll_for(64, "cpu")
    assert rc.layer_loop(256, "gpu") is True and rc.layer_loop(512, "gpu") == "indexed"
    assert rc.layer_loop(16, "cpu") == 1 and RunnerConfig(prefill_layers="scan").layer_loop(512, "gpu") == 1
    indexed = RunnerConfig(prefill_layers="indexed")
    assert indexed.layer_loop(256, "gpu") is True and indexed.layer_loop(512, "gpu") == "indexed"
    with pytest.raises(ValueError, match="prefill_layers"):
        RunnerConfig(prefill_layers="unrolled")


def test_indexed_layers_share_their_fusions():
    """unroll="indexed" (models/deepseek.py run_layers): straight-line layers with no while loop that read
    their weights by runtime indices, so a deeper model adds no new fused computations (XLA compiles and
    autotunes each once), where unroll=True slices at constant offsets and adds computations with depth.
    Compiled from the params' shapes alone (no weights drawn); 4 and 5 layers: 3 and 4 MoE layers."""
    import dataclasses
    import os
    import re

    from deepinfer_jax.weights.pending import abstract_from_specs

    base = ModelConfig.from_json_file(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models",
                                                   "tiny-deepseek-v2.json"))

    def computations(num_layers, unroll):
        cfg = dataclasses.replace(base, num_hidden_layers=num_layers)
        params = abstract_from_specs(cfg, jnp.float32)
        cache = jax.eval_shape(lambda: init_kv_cache(cfg, 4, PAGE, jnp.float32))
        meta = _meta(np.zeros((1, 12), np.int32), [[1, 2]], 0, 12)
        text = jax.jit(lambda p, c, m: forward_paged(p, cfg, c, m, unroll=unroll)).lower(
            params, cache, meta).compile().as_text()
        assert " while(" not in text
        bodies = re.findall(r"\n%[\w.]+ \(.*?\) -> [^\n]*\{\n(.*?)\n\}", text, re.S)
        return {re.sub(r"%[\w.\-]+", "%", re.sub(r"metadata=\{[^}]*\}", "", b)) for b in bodies}

    assert len(computations(5, "indexed")) == len(computations(4, "indexed"))
    assert len(computations(5, True)) > len(computations(4, True))


def test_indexed_layers_copy_one_layers_weights_at_a_time():
    """unroll="indexed": each layer's weight slices are copied out when its turn comes, so a step's temporaries hold
    about one layer's weights, not every layer's (all of them up front took 13 GiB of an 8B dense model's prefill
    step). XLA's memory analysis of the compiled step (CPU), a 16-layer dense model of 7.4 MiB a layer: its
    temporaries stay under four layers' weights (with the slices all made first: 118 MiB, more than all the layers)."""
    from deepinfer_jax.models import registry
    from deepinfer_jax.weights.pending import abstract_from_specs

    cfg = ModelConfig.from_hf_dict(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1024, hidden_size=512,
        intermediate_size=2048, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu"))
    params = abstract_from_specs(cfg, jnp.bfloat16)
    layer_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params["segments"])) / cfg.num_hidden_layers
    cache = jax.eval_shape(lambda: registry.init_kv_cache(cfg, 64, PAGE, jnp.bfloat16))
    meta = _meta(np.zeros((1, 4 * PAGE), np.int32), [[1, 2, 3, 4]], 0, 4 * PAGE, width=4 * PAGE)
    compiled = jax.jit(lambda p, c, m: registry.family_of(cfg).forward_paged(p, cfg, c, m, unroll="indexed"),
                       donate_argnums=1).lower(params, cache, meta).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 4 * layer_bytes


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_grouped_noaux"])
def test_shared_experts_inside_the_kernels_equal_the_shared_mlp(hf_case, case):
    """RunnerConfig.fuse_shared_experts: the shared MLP computed as extra experts inside the Pallas MoE
    kernels (2 shared experts for the V2 case, 1 for V3) gives the logits of the separate shared MLP,
    scanned and unrolled; quantized weights keep the separate MLP."""
    from deepinfer_jax.models.moe import shared_into_kernels
    from deepinfer_jax.models.quant import quantize_params

    _, path = hf_case(case)
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    moe_seg = next(sp for seg, sp in zip(layer_segments(cfg), params["segments"]) if seg.kind == "moe")
    assert shared_into_kernels(moe_seg["moe"], "pallas_interpret", None)
    assert not shared_into_kernels(moe_seg["moe"], "ragged", None)
    assert shared_into_kernels(moe_seg["moe"], "pallas_interpret", None, 256)
    assert not shared_into_kernels(moe_seg["moe"], "pallas_interpret", None, 512)  # prefill sizes: apart
    qmoe = quantize_params(params, "int8", group_size=16)["segments"][1]["moe"]
    assert not shared_into_kernels(qmoe, "pallas_interpret", None)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (1, 10))
    meta = _meta(ids, [[1, 2]], 0, 10)
    for unroll in (1, True):
        outs = []
        for fuse in (False, True):
            cache = init_kv_cache(cfg, 4, PAGE, jnp.float32)
            step = jax.jit(lambda p, c, m, f=fuse, u=unroll: forward_paged(
                p, cfg, c, m, moe_impl="pallas_interpret", unroll=u, fuse_shared_experts=f))
            outs.append(step(params, cache, meta))
        np.testing.assert_allclose(np.asarray(outs[1][0]), np.asarray(outs[0][0]), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(outs[1][1]), np.asarray(outs[0][1]), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_flat_plain_rope"])
def test_routing_inside_the_kernel_equals_the_xla_router(hf_case, case, monkeypatch):
    """RunnerConfig.fuse_moe_routing: kernels/moe_route.py routes and aligns the copies (greedy softmax /
    noaux_tc sigmoid with one group), alone and with the shared experts fused: same logits, same experts."""
    from deepinfer_jax.kernels import moe_route
    from deepinfer_jax.models.moe import routing_into_kernels

    calls = []
    real = moe_route.route_align
    monkeypatch.setattr(moe_route, "route_align", lambda *a, **k: calls.append(k["num_shared"]) or real(*a, **k))

    _, path = hf_case(case)
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    moe_seg = next(sp for seg, sp in zip(layer_segments(cfg), params["segments"]) if seg.kind == "moe")
    assert routing_into_kernels(cfg, "pallas_interpret", None, 16, moe_seg["moe"]["experts"])
    assert not routing_into_kernels(cfg, "pallas_interpret", None, 12, moe_seg["moe"]["experts"])  # not a power of 2
    ids = np.random.default_rng(8).integers(0, cfg.vocab_size, (1, 16))
    meta = _meta(ids, [[1, 2]], 0, 16)
    outs = []
    for routing, shared in ((False, False), (True, False), (True, True)):
        cache = init_kv_cache(cfg, 4, PAGE, jnp.float32)
        step = jax.jit(lambda p, c, m, r=routing, s=shared: forward_paged(
            p, cfg, c, m, moe_impl="pallas_interpret", return_routing=True, fuse_moe_routing=r, fuse_shared_experts=s))
        outs.append(step(params, cache, meta))
    for out in outs[1:]:
        np.testing.assert_allclose(np.asarray(out[0]), np.asarray(outs[0][0]), rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(outs[0][2]))
    assert calls == [0, cfg.n_shared_experts]  # traced once per variant (one scanned MoE body each)


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_flat_plain_rope"])
def test_decode_projection_kernel_equals_xla_gemms(hf_case, case, monkeypatch):
    """RunnerConfig.decode_projection_kernel: a decode-size step reads o_proj and the dense MLP in place
    from the stacked weights (kernels/decode_matmul.py, interpret mode): the same
    logits and cache as XLA's GEMMs. Prefill-size steps, the reference path, quantized weights and a
    disabled flag keep XLA's GEMMs."""
    from deepinfer_jax.kernels import decode_matmul
    from deepinfer_jax.models.decode_kernels import decode_stacked
    from deepinfer_jax.models.quant import quantize_params

    calls = []
    real = decode_matmul.decode_matmul
    monkeypatch.setattr(decode_matmul, "decode_matmul", lambda x, w, *a, **k: calls.append(w.shape) or real(x, w, *a, **k))

    _, path = hf_case(case)
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    per_segment = 0
    for seg, sp in zip(layer_segments(cfg), params["segments"]):
        names = set(decode_stacked(sp, 16, "pallas_interpret", None, True))
        mlp = {("mlp", "gate_up"), ("mlp", "down")} if seg.kind == "dense" else set()
        assert names == {("attn", "o_proj")} | mlp
        per_segment += len(names)
        assert not decode_stacked(sp, 128, "pallas_interpret", None, True)  # a prefill-size step
        assert not decode_stacked(sp, 16, "reference", None, True)
        assert not decode_stacked(sp, 16, "pallas_interpret", None, False)
    qsegs = quantize_params(params, "int8", group_size=16)["segments"]
    assert ("attn", "o_proj") not in set().union(*(decode_stacked(sp, 16, "pallas_interpret", None, True)
                                                   for sp in qsegs))
    ids = np.random.default_rng(9).integers(0, cfg.vocab_size, (1, 12))
    outs = []
    for enabled in (False, True):
        cache = init_kv_cache(cfg, 4, PAGE, jnp.float32)
        step = jax.jit(lambda p, c, m, e=enabled: forward_paged(
            p, cfg, c, m, attn_impl="pallas_interpret", moe_impl="pallas_interpret", decode_projection_kernel=e))
        logits, cache = step(params, cache, _meta(ids, [[1, 2]], 0, 11))  # 11 tokens in a 16-slot step
        dec, cache = step(params, cache, _meta(ids, [[1, 2]], 11, 1))  # then one decode token
        outs.append((logits, dec, cache))
    # The enabled step was traced once (both steps have 16 slots): one kernel per projection and segment.
    assert len(calls) == per_segment
    for got, want in zip(outs[1], outs[0]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    full = np.asarray(forward(params, cfg, jnp.asarray(ids, jnp.int32)))[0]
    np.testing.assert_allclose(np.asarray(outs[1][1])[0], full[11], atol=5e-5)


def test_grouped_routing_keeps_the_xla_router(hf_case):
    from deepinfer_jax.models.moe import routing_into_kernels

    _, path = hf_case("v3_grouped_noaux")
    cfg = ModelConfig.from_model_dir(path)
    assert cfg.n_group > 1
    experts = {"gate_up": jnp.zeros((16, 64, 2, 32))}
    assert not routing_into_kernels(cfg, "pallas", None, 16, experts)
