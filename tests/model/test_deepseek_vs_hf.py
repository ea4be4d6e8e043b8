"""The pure-JAX DeepSeek forward equals HF transformers (eager attention, eager experts) in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import hf_logits
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.deepseek import forward
from deepinfer_jax.models.moe import route
from deepinfer_jax.weights.hf_loader import load_hf_checkpoint


def _load(path):
    cfg = ModelConfig.from_model_dir(path)
    return load_hf_checkpoint(path, cfg, jnp.float32, progress=False)


@pytest.mark.parametrize("moe_impl", ["ragged", "dense"])
def test_all_position_logits_match_hf(hf_case, case_name, moe_impl):
    model, path = hf_case(case_name)
    cfg, params = _load(path)
    assert model.model.layers[0].self_attn.scaling == pytest.approx(cfg.softmax_scale, rel=1e-12)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 48))
    ref = hf_logits(model, ids)
    fwd = jax.jit(lambda p, t: forward(p, cfg, t, moe_impl=moe_impl))
    out = np.asarray(fwd(params, jnp.asarray(ids, jnp.int32)))
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() <= 1e-4
    # Sanity: the test could fail — a different model gives different logits.
    assert np.abs(ref).max() > 0.5


@pytest.mark.parametrize("absorb_max_tokens", [0, 1 << 20])
def test_absorbed_and_expanded_mla_agree(hf_case, case_name, absorb_max_tokens, monkeypatch):
    """Both ways of absorbing W_UK into the query (mla.absorb_query: W_UK's slice, or the zero-padded
    query against kv_b_proj's whole rows, forced here for all 66 tokens) give the expanded form's
    logits."""
    from deepinfer_jax.models import mla

    monkeypatch.setattr(mla, "ABSORB_FULL_WIDTH_MAX_TOKENS", absorb_max_tokens)
    _, path = hf_case(case_name)
    cfg, params = _load(path)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 33)), jnp.int32)
    a = forward(params, cfg, ids, mla_form="expanded")
    b = forward(params, cfg, ids, mla_form="absorbed")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0)


def test_router_matches_hf(hf_case, case_name):
    """Selected expert sets and weights equal HF's router on every MoE layer input."""
    import torch

    model, path = hf_case(case_name)
    cfg, params = _load(path)
    x = np.random.default_rng(3).standard_normal((64, cfg.hidden_size)).astype(np.float32)
    hf_gate = model.model.layers[1].mlp.gate
    with torch.no_grad():
        out = hf_gate(torch.tensor(x))
    hf_w, hf_idx = out[-2].numpy(), out[-1].numpy()
    moe_p = jax.tree.map(lambda a: a[0], params["segments"][1]["moe"])
    w, idx = route(moe_p, cfg, jnp.asarray(x))
    w, idx = np.asarray(w), np.asarray(idx)
    for t in range(x.shape[0]):
        ours = dict(zip(idx[t].tolist(), w[t].tolist()))
        theirs = dict(zip(hf_idx[t].tolist(), hf_w[t].tolist()))
        assert ours.keys() == theirs.keys()
        for e in ours:
            assert ours[e] == pytest.approx(theirs[e], abs=1e-6)
    # Routing is not flat: many different expert sets are chosen.
    assert len({tuple(sorted(r)) for r in idx.tolist()}) > 8


def test_forward_is_differentiable(hf_case):
    _, path = hf_case("v3_grouped_noaux")
    cfg, params = _load(path)
    ids = jnp.asarray(np.arange(12).reshape(1, 12) % cfg.vocab_size, jnp.int32)

    def loss(p):
        logits = forward(p, cfg, ids, moe_impl="dense")
        return -jnp.mean(jax.nn.log_softmax(logits[0, :-1])[jnp.arange(11), ids[0, 1:]])

    # the squared norm of every parameter's gradient, in one program
    gn = float(jax.jit(lambda p: sum(jnp.sum(g * g) for g in jax.tree.leaves(jax.grad(loss)(p))))(params))
    assert np.isfinite(gn) and gn > 0
