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

PAGE = 8


def _step(params, cfg, cache, ids, pages, chunks, pad_to=None, attn_impl="reference", **kw):
    """chunks: per sequence (start, n). Flattens them into one ragged step, optionally padded."""
    tid, pos, sid, slot, last = [], [], [], [], []
    for s, (start, n) in enumerate(chunks):
        for p in range(start, start + n):
            tid.append(ids[s][p])
            pos.append(p)
            sid.append(s)
            slot.append(pages[s][p // PAGE] * PAGE + p % PAGE)
        last.append(len(tid) - 1)
    while pad_to and len(tid) < pad_to:  # padding tokens write into the null page 0
        tid.append(0)
        pos.append(0)
        sid.append(0)
        slot.append(len(tid) % PAGE)
    table = np.zeros((len(pages), max(map(len, pages)) + 1), np.int32)
    for s, pg in enumerate(pages):
        table[s, : len(pg)] = pg
    arr = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    meta = StepMetadata(arr(tid), arr(pos), arr(sid), arr(slot), jnp.asarray(table), arr(last))
    return forward_paged(params, cfg, cache, meta, attn_impl=attn_impl, **kw)


def test_prefill_chunks_then_decode_equal_full_forward(hf_case, case_name):
    _, path = hf_case(case_name)
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, cfg.vocab_size, (3, 40))
    full = np.asarray(forward(params, cfg, jnp.asarray(ids, jnp.int32)))
    # Non-contiguous, interleaved pages; page 0 is never used by a sequence.
    pages = [[5, 2, 9, 14, 20], [3, 11, 7, 1, 18], [6, 4, 13, 17, 8]]
    cache = init_kv_cache(cfg, 24, PAGE, jnp.float32)
    # Step 1: chunks of different lengths, one of them a single token; padded batch.
    logits, cache = _step(params, cfg, cache, ids, pages, [(0, 17), (0, 1), (0, 9)], pad_to=32)
    np.testing.assert_allclose(np.asarray(logits), full[[0, 1, 2], [16, 0, 8]], atol=2e-5)
    # Step 2: second prefill chunks mixed with a decode.
    logits, cache = _step(params, cfg, cache, ids, pages, [(17, 12), (1, 1), (9, 20)])
    np.testing.assert_allclose(np.asarray(logits), full[[0, 1, 2], [28, 1, 28]], atol=2e-5)
    # Decode steps.
    for t in range(6):
        logits, cache = _step(params, cfg, cache, ids, pages, [(29 + t, 1), (2 + t, 1), (29 + t, 1)], pad_to=8)
        np.testing.assert_allclose(np.asarray(logits), full[[0, 1, 2], [29 + t, 2 + t, 29 + t]], atol=2e-5)


@pytest.mark.parametrize("prefill_attention", ["expanded", "absorbed"])
def test_pallas_attention_kernels_equal_full_forward(hf_case, prefill_attention, monkeypatch):
    """attn_impl="pallas_interpret": steps with more token slots than sequence rows run the prefill
    path (chunks over cached prefixes, decode tokens, padding): split into each chunk in the expanded
    form plus its cached context (kernels/mla_chunk.py), or all absorbed (kernels/mla_prefill.py); the
    unpadded decode step runs the decode kernel; all give the full forward's logits."""
    from deepinfer_jax.models import deepseek

    _, path = hf_case("v2_greedy_yarn")
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, (3, 40))
    full = np.asarray(forward(params, cfg, jnp.asarray(ids, jnp.int32)))
    pages = [[5, 2, 9, 14, 20], [3, 11, 7, 1, 18], [6, 4, 13, 17, 8]]
    cache = init_kv_cache(cfg, 24, PAGE, jnp.float32)
    splits = []
    plan = deepseek.chunk_split_plan
    monkeypatch.setattr(deepseek, "chunk_split_plan", lambda *a: splits.append(plan(*a) is not None) or plan(*a))
    for chunks, pad_to, rows in [([(0, 17), (0, 1), (0, 9)], 32, [16, 0, 8]),
                                 ([(17, 12), (1, 1), (9, 20)], None, [28, 1, 28]),
                                 ([(29, 1), (2, 1), (29, 1)], None, [29, 2, 29])]:  # T == S: the decode kernel
        logits, cache = _step(params, cfg, cache, ids, pages, chunks, pad_to, attn_impl="pallas_interpret",
                              prefill_attention=prefill_attention)
        np.testing.assert_allclose(np.asarray(logits), full[[0, 1, 2], rows], atol=2e-5)
    assert splits == ([True, True, False] if prefill_attention == "expanded" else [False] * 3)


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
    autotunes each once), where unroll=True slices at constant offsets and adds computations with depth."""
    import dataclasses
    import os
    import re

    from deepinfer_jax.weights.random_init import random_params

    base = ModelConfig.from_json_file(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models",
                                                   "tiny-deepseek-v2.json"))

    def computations(num_layers, unroll):
        cfg = dataclasses.replace(base, num_hidden_layers=num_layers)
        params = random_params(cfg, jnp.float32)
        cache = init_kv_cache(cfg, 4, PAGE, jnp.float32)
        meta = _meta(np.zeros((1, 12), np.int32), [[1, 2]], 0, 12)
        text = jax.jit(lambda p, c, m: forward_paged(p, cfg, c, m, unroll=unroll)).lower(
            params, cache, meta).compile().as_text()
        assert " while(" not in text
        bodies = re.findall(r"\n%[\w.]+ \(.*?\) -> [^\n]*\{\n(.*?)\n\}", text, re.S)
        return {re.sub(r"%[\w.\-]+", "%", re.sub(r"metadata=\{[^}]*\}", "", b)) for b in bodies}

    assert len(computations(8, "indexed")) == len(computations(5, "indexed"))
    assert len(computations(8, True)) > len(computations(5, True))


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


def _decode_kernel_on_and_off(hf_case, case, flag: str, seed: int, **extra):
    """Three sequences prefilled in one 64-slot step, then two decode steps of 16 token slots and 16
    sequence rows (the per-token decode kernel's steps), with forward_paged's `flag` off and on (Pallas
    path, interpret mode; `extra`: more forward_paged flags, the same both times). Each decode step's logits
    must equal the full forward's; returns (cfg, params)."""
    _, path = hf_case(case)
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (3, 40))
    full = np.asarray(forward(params, cfg, jnp.asarray(ids, jnp.int32)))
    pages = [[5, 2, 9, 14, 20], [3, 11, 7, 1, 18], [6, 4, 13, 17, 8]] + [[0]] * 13  # 16 sequence rows
    outs = []
    for enabled in (False, True):
        kw = {"attn_impl": "pallas_interpret", "moe_impl": "pallas_interpret", **extra, flag: enabled}
        cache = init_kv_cache(cfg, 24, PAGE, jnp.float32)
        _, cache = _step(params, cfg, cache, ids, pages, [(0, 30), (0, 3), (0, 20)], pad_to=64, **kw)
        steps = []
        for t in range(2):
            logits, cache = _step(params, cfg, cache, ids, pages, [(30 + t, 1), (3 + t, 1), (20 + t, 1)],
                                  pad_to=16, **kw)
            steps.append(np.asarray(logits)[:3])
            np.testing.assert_allclose(steps[-1], full[[0, 1, 2], [30 + t, 3 + t, 20 + t]], atol=5e-5)
        outs.append((np.stack(steps), np.asarray(cache)))
    # The same logits and cache either way (later layers: fp32 rounding).
    np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(outs[1][1], outs[0][1], rtol=2e-5, atol=2e-5)
    return cfg, params


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_flat_plain_rope"])
def test_decode_output_kernel_equals_merge_then_einsum(hf_case, case, monkeypatch):
    """RunnerConfig.decode_output_kernel: a decode step the per-token kernel serves merges the
    attention's splits and applies W_UV in one kernel (kernels/mla_output.py) in every layer: the same
    logits and cache as the XLA merge and einsum, and the full forward's logits. A prefill-bucket step
    (more slots than rows) keeps the other path."""
    from deepinfer_jax.kernels import mla_output

    calls = []
    real = mla_output.merge_value_projection
    monkeypatch.setattr(mla_output, "merge_value_projection",
                        lambda *a, **k: calls.append(a[3].shape) or real(*a, **k))
    cfg, params = _decode_kernel_on_and_off(hf_case, case, "decode_output_kernel", seed=11)
    # Only the two decode steps; each traces one scanned layer body per segment, handed its segment's
    # stacked kv_b_proj.
    assert calls == 2 * [(seg.num_layers, *params["segments"][i]["attn"]["kv_b_proj"].shape[1:])
                         for i, seg in enumerate(layer_segments(cfg))]


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_grouped_noaux"])
def test_decode_absorb_kernel_equals_the_xla_absorption(hf_case, case, monkeypatch):
    """RunnerConfig.decode_absorb_kernel: a decode step the per-token kernel serves absorbs the query
    through W_UK and rotates its rope part in one kernel (kernels/mla_absorb.py) reading the whole q
    projection (with and without q-LoRA) and the stacked kv_b_proj: the same logits and cache as XLA's
    absorption and RoPE, and the full forward's logits. A prefill-bucket step keeps XLA's."""
    from deepinfer_jax.kernels import mla_absorb

    calls = []
    real = mla_absorb.absorb_query
    monkeypatch.setattr(mla_absorb, "absorb_query", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    cfg, _ = _decode_kernel_on_and_off(hf_case, case, "decode_absorb_kernel", seed=12)
    # Only the two decode steps, one scanned layer body per segment, each on the whole q [16, H, dn + dr].
    H, width = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert calls == 2 * len(layer_segments(cfg)) * [(16, H, width)]


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_grouped_noaux"])
def test_decode_latent_kernel_equals_the_xla_norm_rope_and_write(hf_case, case, monkeypatch):
    """RunnerConfig.decode_latent_kernel: in a decode step the absorb kernel serves, its launch also takes the
    kv_a projection's raw rows, applies kv_a_layernorm (read in place from the stacked norms) and RoPE and
    writes the latents into the cache in place (mla_absorb.absorb_query_write_latents): the same logits and
    cache as XLA's norm, RoPE and scatter, and the full forward's logits. A prefill-bucket step, or the absorb
    kernel off, keeps XLA's."""
    from deepinfer_jax.kernels import mla_absorb
    from deepinfer_jax.models.decode_kernels import decode_absorb_weights, decode_latent_weights

    calls = []
    real = mla_absorb.absorb_query_write_latents
    monkeypatch.setattr(mla_absorb, "absorb_query_write_latents",
                        lambda *a, **k: calls.append((a[5].shape, a[6].shape, a[7].shape, k["eps"])) or real(*a, **k))
    cfg, params = _decode_kernel_on_and_off(hf_case, case, "decode_latent_kernel", seed=14, decode_absorb_kernel=True)
    # Only the two decode steps, one scanned layer body per segment: the raw rows [16, R + dr], the
    # segment's stacked kv_a_layernorm, the whole cache.
    R, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    cache = (cfg.num_hidden_layers, 24, PAGE, R + dr)
    assert calls == 2 * [((16, R + dr), (seg.num_layers, R), cache, cfg.latent_norm_eps) for seg in layer_segments(cfg)]
    sp = params["segments"][0]
    meta = StepMetadata(*(jnp.zeros(16, jnp.int32),) * 4, jnp.zeros((16, 2), jnp.int32), jnp.zeros(16, jnp.int32))
    kv_b = decode_absorb_weights(sp, cfg, meta, "pallas_interpret", None, None, True)
    assert decode_latent_weights(sp, cfg, meta, kv_b, True) is sp["attn"]["kv_a_layernorm"]
    assert decode_latent_weights(sp, cfg, meta, None, True) is None  # the absorb kernel off: XLA's path
    assert decode_latent_weights(sp, cfg, meta, kv_b, False) is None


def test_grouped_routing_keeps_the_xla_router(hf_case):
    from deepinfer_jax.models.moe import routing_into_kernels

    _, path = hf_case("v3_grouped_noaux")
    cfg = ModelConfig.from_model_dir(path)
    assert cfg.n_group > 1
    experts = {"gate_up": jnp.zeros((16, 64, 2, 32))}
    assert not routing_into_kernels(cfg, "pallas", None, 16, experts)


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_flat_plain_rope"])
def test_moe_single_launch_equals_two_launches(hf_case, case, monkeypatch):
    """RunnerConfig.moe_single_launch: where a step routes in its kernel (here all of them: 64 and 16 slots),
    both expert kernels run in one launch (kernels/moe_gmm.py `single_launch`): the same logits and cache as
    two launches, and the full forward's logits."""
    from deepinfer_jax.kernels import moe_route

    calls = []
    real = moe_route.moe_experts_aligned
    monkeypatch.setattr(moe_route, "moe_experts_aligned",
                        lambda *a, **k: calls.append(k["single_launch"]) or real(*a, **k))
    cfg, _ = _decode_kernel_on_and_off(hf_case, case, "moe_single_launch", seed=14, fuse_moe_routing=True,
                                       fuse_shared_experts=True)
    n = 3 * sum(seg.kind == "moe" for seg in layer_segments(cfg))  # three steps, one traced body per segment
    assert calls == n * [False] + n * [True]


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_flat_plain_rope"])
def test_decode_oproj_launch_equals_two_launches(hf_case, case, monkeypatch):
    """RunnerConfig.decode_oproj_launch: in a decode step the output kernel serves, o_proj runs in its launch
    (kernels/mla_output.py merge_value_output_projection): the same logits and cache as the output kernel then
    decode_matmul, and the full forward's logits. The 64-slot prefill step keeps its own attention."""
    from deepinfer_jax.kernels import mla_output

    calls = []
    real = mla_output.merge_value_output_projection
    monkeypatch.setattr(mla_output, "merge_value_output_projection",
                        lambda *a, **k: calls.append(a[4].shape) or real(*a, **k))
    cfg, params = _decode_kernel_on_and_off(hf_case, case, "decode_oproj_launch", seed=15,
                                            decode_projection_kernel=True, decode_output_kernel=True)
    # The two decode steps, one traced layer body per segment, each handed its segment's o_proj as [L, H * dv, D].
    H, dv, D = cfg.num_attention_heads, cfg.v_head_dim, cfg.hidden_size
    assert calls == 2 * [(seg.num_layers, H * dv, D) for seg in layer_segments(cfg)]


@pytest.mark.parametrize("case, oproj", [("v2_greedy_yarn", False), ("v2_greedy_yarn", True), ("v3_flat_plain_rope", True)])
def test_decode_route_launch_equals_the_xla_path(hf_case, case, oproj, monkeypatch):
    """RunnerConfig.decode_route_launch: in a decode step's MoE layers, o_proj's split-K partials (from
    decode_matmul, or from the output kernel's launch with decode_oproj_launch) go to the residual, the
    post-attention RMSNorm, the router's logits and the routing in one launch (kernels/residual_route.py),
    and the MoE takes that routing: the same logits and cache as the separate path, and the full forward's."""
    from deepinfer_jax.kernels import residual_route

    calls = []
    real = residual_route.residual_route
    monkeypatch.setattr(residual_route, "residual_route", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    cfg, _ = _decode_kernel_on_and_off(hf_case, case, "decode_route_launch", seed=17, decode_projection_kernel=True,
                                       fuse_moe_routing=True, fuse_shared_experts=True, moe_single_launch=True,
                                       decode_output_kernel=True, decode_oproj_launch=oproj)
    # The MoE segment of the 64-slot prefill step and of the two 16-slot decode steps, each with o_proj's
    # partials [split_k, slots, D].
    moe = sum(seg.kind == "moe" for seg in layer_segments(cfg))
    assert [p[1:] for p in calls] == [(64, cfg.hidden_size)] * moe + [(16, cfg.hidden_size)] * 2 * moe


@pytest.mark.parametrize("case, combine_norm", [("v2_greedy_yarn", False), ("v3_flat_plain_rope", False),
                                                 ("v3_flat_plain_rope", True)])
def test_decode_moe_launch_equals_two_launches(hf_case, case, combine_norm, monkeypatch):
    """RunnerConfig.decode_moe_launch: with the route launch on, a decode step's MoE layers run the route launch
    and the experts' single launch as one launch (kernels/route_experts.py), the shared MLP inside it: the same
    logits and cache as the two launches, and the full forward's; with decode_combine_norm the launch hands its
    rows uncombined to the combine-and-norm launch."""
    from deepinfer_jax.kernels import route_experts

    calls = []
    real = route_experts.route_experts
    monkeypatch.setattr(route_experts, "route_experts",
                        lambda *a, **k: calls.append((a[0].shape[1], k["combine"])) or real(*a, **k))
    cfg, _ = _decode_kernel_on_and_off(hf_case, case, "decode_moe_launch", seed=21, decode_projection_kernel=True,
                                       fuse_moe_routing=True, fuse_shared_experts=True, moe_single_launch=True,
                                       decode_output_kernel=True, decode_route_launch=True,
                                       decode_combine_norm=combine_norm)
    # The MoE segments of the 64-slot prefill step and of the two 16-slot decode steps.
    moe = sum(seg.kind == "moe" for seg in layer_segments(cfg))
    assert calls == [(n, not combine_norm) for n in (64, 16, 16) for _ in range(moe)]


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_flat_plain_rope"])
def test_decode_moe_dense_equals_the_aligned_launch(hf_case, case, monkeypatch):
    """RunnerConfig.decode_moe_dense: the 16-slot decode steps run the route-and-experts launch in its token-dense
    form (kernels/route_experts.py route_experts_dense); the 64-slot prefill step keeps the aligned form: the same
    logits and cache as the aligned form, and the full forward's."""
    from deepinfer_jax.kernels import route_experts

    calls = []
    real = route_experts.route_experts_dense
    monkeypatch.setattr(route_experts, "route_experts_dense", lambda *a, **k: calls.append(a[0].shape[1]) or real(*a, **k))
    cfg, _ = _decode_kernel_on_and_off(hf_case, case, "decode_moe_dense", seed=22, decode_projection_kernel=True,
                                       fuse_moe_routing=True, fuse_shared_experts=True, moe_single_launch=True,
                                       decode_output_kernel=True, decode_route_launch=True, decode_moe_launch=True)
    moe = sum(seg.kind == "moe" for seg in layer_segments(cfg))
    assert calls == [16] * 2 * moe


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_flat_plain_rope"])
def test_decode_residual_norm_equals_the_xla_path(hf_case, case, monkeypatch):
    """RunnerConfig.decode_residual_norm: in every layer of the steps whose o_proj is read in place (decode
    sizes), o_proj's split-K partials are added to the residual and the post-attention RMSNorm taken in one
    launch (kernels/residual_route.py residual_norm): the same logits and cache as XLA's add and norm, and
    the full forward's logits; with the route launch on, that launch keeps the MoE layers' work."""
    from deepinfer_jax.kernels import residual_route

    calls = []
    real = residual_route.residual_norm
    monkeypatch.setattr(residual_route, "residual_norm",
                        lambda *a, **k: calls.append((a[0].shape[1:], a[2].shape)) or real(*a, **k))
    cfg, _ = _decode_kernel_on_and_off(hf_case, case, "decode_residual_norm", seed=19, decode_projection_kernel=True,
                                       decode_output_kernel=True)
    # The 64-slot prefill step and the two 16-slot decode steps, one traced body per segment, each with the
    # partials [split_k, slots, D] and the segment's stacked norm [L, D].
    D, segs = cfg.hidden_size, layer_segments(cfg)
    assert calls == [((n, D), (seg.num_layers, D)) for n in (64, 16, 16) for seg in segs]
    calls.clear()
    _decode_kernel_on_and_off(hf_case, case, "decode_residual_norm", seed=20, decode_projection_kernel=True,
                              decode_output_kernel=True, fuse_moe_routing=True, fuse_shared_experts=True,
                              moe_single_launch=True, decode_route_launch=True)
    assert calls == [((n, D), (seg.num_layers, D)) for n in (64, 16, 16) for seg in segs if seg.kind == "dense"]


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_flat_plain_rope"])
def test_decode_combine_norm_equals_the_xla_path(hf_case, case, monkeypatch):
    """RunnerConfig.decode_combine_norm: in the MoE layers of the steps that route in the kernel (all three
    here), the expert rows are combined into the residual and the next layer's input RMSNorm taken in one
    launch (kernels/residual_route.py combine_residual_norm), the normed input passed on to the next layer:
    the same logits and cache as XLA's combine, add and norm, and the full forward's logits; with the
    residual norm launch on too."""
    from deepinfer_jax.kernels import residual_route

    calls = []
    real = residual_route.combine_residual_norm
    monkeypatch.setattr(residual_route, "combine_residual_norm",
                        lambda *a, **k: calls.append((a[2].shape, a[4].shape)) or real(*a, **k))
    kw = dict(fuse_moe_routing=True, fuse_shared_experts=True, moe_single_launch=True)
    cfg, _ = _decode_kernel_on_and_off(hf_case, case, "decode_combine_norm", seed=21, **kw)
    # The 64-slot prefill step and the two 16-slot decode steps, one traced body per MoE segment: the
    # weights [slots, k + shared] and the segment's stacked input norms [L, D].
    K = cfg.num_experts_per_tok + cfg.n_shared_experts
    moe = [seg for seg in layer_segments(cfg) if seg.kind == "moe"]
    assert calls == [((n, K), (seg.num_layers, cfg.hidden_size)) for n in (64, 16, 16) for seg in moe]
    calls.clear()
    _decode_kernel_on_and_off(hf_case, case, "decode_combine_norm", seed=22, decode_projection_kernel=True,
                              decode_output_kernel=True, decode_residual_norm=True, **kw)
    assert len(calls) == 3 * len(moe)


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_flat_plain_rope"])
def test_decode_qkv_launch_equals_the_xla_projections(hf_case, case, monkeypatch):
    """RunnerConfig.decode_qkv_launch: in a decode step whose absorb launch writes the latents, on a model without
    q-LoRA, the q / kv_a projections run in that launch with both weights read in place from the segment's
    stacked arrays (kernels/mla_qkv.py): the same logits and cache as XLA's GEMM, and the full forward's logits.
    The prefill step keeps XLA's path."""
    from deepinfer_jax.kernels import mla_qkv

    calls = []
    real = mla_qkv.project_absorb_write_latents
    monkeypatch.setattr(mla_qkv, "project_absorb_write_latents",
                        lambda *a, **k: calls.append((a[0].shape, a[1].shape, a[2].shape)) or real(*a, **k))
    cfg, _ = _decode_kernel_on_and_off(hf_case, case, "decode_qkv_launch", seed=18, decode_absorb_kernel=True,
                                       decode_latent_kernel=True, decode_output_kernel=True)
    # The two decode steps, one traced layer body per segment: x [16, D], the segment's q_proj and kv_a.
    D, H, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    W, dr = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_rope_head_dim
    assert calls == 2 * [((16, D), (seg.num_layers, D, H, W), (seg.num_layers, D, R + dr)) for seg in layer_segments(cfg)]


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_flat_plain_rope"])
def test_decode_merged_qkv_equals_two_projections(hf_case, case, monkeypatch):
    """RunnerConfig.decode_merged_qkv: in a decode step whose absorb launch writes the latents, on a model without
    q-LoRA, the q / kv_a projections are one GEMM whose output [16, H * (dn + dr) + R + dr] the launch reads in
    place: the same logits and cache as the two projections' outputs handed over separately, and the full
    forward's logits."""
    from deepinfer_jax.kernels import mla_absorb

    calls = []
    real = mla_absorb.absorb_query_write_latents
    monkeypatch.setattr(mla_absorb, "absorb_query_write_latents",
                        lambda *a, **k: calls.append((a[0].shape, a[5] is None)) or real(*a, **k))
    cfg, _ = _decode_kernel_on_and_off(hf_case, case, "decode_merged_qkv", seed=19, decode_absorb_kernel=True,
                                       decode_latent_kernel=True, decode_output_kernel=True)
    H, W, R, dr = (cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                   cfg.qk_rope_head_dim)
    n = len(layer_segments(cfg))  # one traced layer body per segment and step; the prefill step takes neither
    assert calls == 2 * n * [((16, H, W), False)] + 2 * n * [((16, H * W + R + dr), True)]


def test_decode_qkv_launch_applies_without_q_lora_only(hf_case):
    """decode_qkv_weights: the stacked q_proj and kv_a where the absorb launch writes the latents, a model has no
    q-LoRA and the flag is on; None with q-LoRA (its q goes through q_a's norm and q_b first), without the latent
    write, or with the flag off."""
    from deepinfer_jax.models.decode_kernels import decode_qkv_weights

    meta = StepMetadata(*(jnp.zeros(16, jnp.int32),) * 4, jnp.zeros((16, 2), jnp.int32), jnp.zeros(16, jnp.int32))
    for case, applies in (("v2_greedy_yarn", True), ("v3_grouped_noaux", False)):
        _, path = hf_case(case)
        cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
        sp = params["segments"][0]
        norm = sp["attn"]["kv_a_layernorm"]
        got = decode_qkv_weights(sp, cfg, meta, norm, "pallas_interpret", True)
        if applies:
            assert got[0] is sp["attn"]["q_proj"] and got[1] is sp["attn"]["kv_a_proj_with_mqa"]
            assert decode_qkv_weights(sp, cfg, meta, norm, "pallas", True) is None  # 8-wide tiles: GPU's dot can't
        else:
            assert got is None
        assert decode_qkv_weights(sp, cfg, meta, None, "pallas_interpret", True) is None
        assert decode_qkv_weights(sp, cfg, meta, norm, "pallas_interpret", False) is None
