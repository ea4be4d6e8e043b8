"""The decode step's kernel and launch switches (RunnerConfig's decode_* and moe_single_launch): each on and off
over the same prefill and decode steps, the same logits and cache, and the full forward's logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config import ModelConfig, RunnerConfig
from deepinfer_jax.models.cache import StepMetadata, init_kv_cache
from deepinfer_jax.models.deepseek import forward, forward_paged
from deepinfer_jax.models.params import layer_segments
from deepinfer_jax.weights.hf_loader import load_hf_checkpoint
from paged_steps import PAGE, step as _step


def _decode_kernel_on_and_off(hf_case, case, flag: str, seed: int, values=(False, True), **extra):
    """Three sequences prefilled in one 64-slot step, then two decode steps of 16 token slots and 16
    sequence rows (the per-token decode kernel's steps), with forward_paged's `flag` off and on (`values`; Pallas
    path, interpret mode; `extra`: more forward_paged flags, the same both times). Each decode step's logits
    must equal the full forward's; returns (cfg, params)."""
    _, path = hf_case(case)
    cfg, params = load_hf_checkpoint(path, ModelConfig.from_model_dir(path), jnp.float32, progress=False)
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (3, 40))
    full = np.asarray(forward(params, cfg, jnp.asarray(ids, jnp.int32)))
    pages = [[5, 2, 9, 14, 20], [3, 11, 7, 1, 18], [6, 4, 13, 17, 8]] + [[0]] * 13  # 16 sequence rows
    outs = []
    for enabled in values:
        kw = {"attn_impl": "pallas_interpret", "moe_impl": "pallas_interpret", **extra, flag: enabled}
        # One program a step size, as the runner jits its steps: the two decode steps share one trace.
        fwd = jax.jit(lambda p, c, m, kw=kw: forward_paged(p, cfg, c, m, **kw))
        cache = init_kv_cache(cfg, 24, PAGE, jnp.float32)
        _, cache = _step(params, cfg, cache, ids, pages, [(0, 30), (0, 3), (0, 20)], pad_to=64, fwd=fwd)
        steps = []
        for t in range(2):
            logits, cache = _step(params, cfg, cache, ids, pages, [(30 + t, 1), (3 + t, 1), (20 + t, 1)],
                                  pad_to=16, fwd=fwd)
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
    # Only the decode steps' program (traced once for both) takes it: one scanned layer body per segment, handed
    # its segment's stacked kv_b_proj.
    assert calls == [(seg.num_layers, *params["segments"][i]["attn"]["kv_b_proj"].shape[1:])
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
    # Only the decode steps' program, one scanned layer body per segment, each on the whole q [16, H, dn + dr].
    H, width = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert calls == len(layer_segments(cfg)) * [(16, H, width)]


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
    # Only the decode steps' program, one scanned layer body per segment: the raw rows [16, R + dr], the
    # segment's stacked kv_a_layernorm, the whole cache.
    R, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    cache = (cfg.num_hidden_layers, 24, PAGE, R + dr)
    assert calls == [((16, R + dr), (seg.num_layers, R), cache, cfg.latent_norm_eps) for seg in layer_segments(cfg)]
    sp = params["segments"][0]
    meta = StepMetadata(*(jnp.zeros(16, jnp.int32),) * 4, jnp.zeros((16, 2), jnp.int32), jnp.zeros(16, jnp.int32))
    kv_b = decode_absorb_weights(sp, cfg, meta, "pallas_interpret", None, None, True)
    assert decode_latent_weights(sp, cfg, meta, kv_b, True) is sp["attn"]["kv_a_layernorm"]
    assert decode_latent_weights(sp, cfg, meta, None, True) is None  # the absorb kernel off: XLA's path
    assert decode_latent_weights(sp, cfg, meta, kv_b, False) is None


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
    n = 2 * sum(seg.kind == "moe" for seg in layer_segments(cfg))  # two programs (64 and 16 slots), a body a segment
    assert calls == n * [False] + n * [True]


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_flat_plain_rope"])
def test_decode_route_launch_equals_the_xla_path(hf_case, case, monkeypatch):
    """RunnerConfig.decode_route_launch: in a decode step's MoE layers, o_proj's split-K partials (from
    decode_matmul) go to the residual, the post-attention RMSNorm, the router's logits and the routing in one
    launch (kernels/residual_route.py), and the MoE takes that routing: the same logits and cache as the separate
    path, and the full forward's."""
    from deepinfer_jax.kernels import residual_route

    calls = []
    real = residual_route.residual_route
    monkeypatch.setattr(residual_route, "residual_route", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    cfg, _ = _decode_kernel_on_and_off(hf_case, case, "decode_route_launch", seed=17, decode_projection_kernel=True,
                                       fuse_moe_routing=True, fuse_shared_experts=True, moe_single_launch=True,
                                       decode_output_kernel=True)
    # The MoE segment of the 64-slot prefill program and of the 16-slot decode one, each with o_proj's
    # partials [split_k, slots, D].
    moe = sum(seg.kind == "moe" for seg in layer_segments(cfg))
    assert [p[1:] for p in calls] == [(64, cfg.hidden_size)] * moe + [(16, cfg.hidden_size)] * moe


@pytest.mark.parametrize("case, tokens", [("v2_greedy_yarn", None), ("v3_flat_plain_rope", (16,))])
def test_decode_moe_launch_equals_two_launches(hf_case, case, tokens, monkeypatch):
    """RunnerConfig.decode_moe_launch: with the route launch on, a decode step's MoE layers run the route launch
    and the experts' single launch as one launch (kernels/route_experts.py), the shared MLP inside it: the same
    logits and cache as the two launches, and the full forward's; decode_moe_launch_tokens (16,) keeps the
    64-slot step on the two launches."""
    from deepinfer_jax.kernels import route_experts

    calls = []
    real = route_experts.route_experts
    monkeypatch.setattr(route_experts, "route_experts",
                        lambda *a, **k: calls.append(a[0].shape[1]) or real(*a, **k))
    cfg, _ = _decode_kernel_on_and_off(hf_case, case, "decode_moe_launch", seed=21, decode_projection_kernel=True,
                                       fuse_moe_routing=True, fuse_shared_experts=True, moe_single_launch=True,
                                       decode_output_kernel=True, decode_route_launch=True,
                                       decode_moe_launch_tokens=tokens)
    # The MoE segments of the 64-slot prefill program (unless `tokens` leaves it out) and of the 16-slot decode one.
    moe = sum(seg.kind == "moe" for seg in layer_segments(cfg))
    sizes = (64, 16) if tokens is None else (16,)
    assert calls == [n for n in sizes for _ in range(moe)]


def test_moe_launch_tokens_reach_the_forward_as_a_tuple():
    """RunnerConfig.decode_moe_launch_tokens: the measured default (32,), a list from a config file made a tuple (the
    step's jit closes over it), None for every size."""
    assert RunnerConfig().forward_switches()["decode_moe_launch_tokens"] == (32,)
    assert RunnerConfig(decode_moe_launch_tokens=[16, "64"]).forward_switches()["decode_moe_launch_tokens"] == (16, 64)
    assert RunnerConfig(decode_moe_launch_tokens=None).forward_switches()["decode_moe_launch_tokens"] is None


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
    n = len(layer_segments(cfg))  # one traced layer body per segment in the decode program; the prefill takes neither
    assert calls == n * [((16, H, W), False)] + n * [((16, H * W + R + dr), True)]
