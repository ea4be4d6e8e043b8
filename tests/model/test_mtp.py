"""models/mtp.py against a hand computation: the MTP input (norms, concat, eh_proj) in numpy, then its
decoder layer run as a one-layer model whose embedding table holds those inputs. HF transformers drops
the MTP layers, so there is no HF reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.deepseek import forward
from deepinfer_jax.models.mtp import mtp_forward
from deepinfer_jax.models.params import init_params
from hf_models import CASES, COMMON

B, S = 2, 5


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def test_mtp_forward_matches_hand_computation():
    cfg = ModelConfig.from_hf_dict({**COMMON, **CASES["v3_grouped_noaux"], "num_nextn_predict_layers": 1})
    params = init_params(cfg, seed=3, dtype=jnp.float32, std=0.05)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, S + 1)).astype(np.int32)
    _, hidden = forward(params, cfg, jnp.asarray(ids[:, :-1]), moe_impl="dense", return_hidden=True)
    got = np.asarray(mtp_forward(params, cfg, hidden, jnp.asarray(ids[:, 1:]), moe_impl="dense"))

    mp = jax.tree.map(np.asarray, params["mtp"][0])
    eps = cfg.rms_norm_eps
    emb = np.asarray(params["embed"])[ids[:, 1:]]
    x = np.concatenate([_rms(emb, mp["enorm"], eps), _rms(np.asarray(hidden), mp["hnorm"], eps)], -1)
    h_in = x @ mp["eh_proj"]  # [B, S, D]
    one = ModelConfig.from_hf_dict({**COMMON, **CASES["v3_grouped_noaux"], "num_hidden_layers": 1,
                                    "first_k_dense_replace": 0, "vocab_size": cfg.vocab_size})
    p1 = {"embed": jnp.asarray(h_in.reshape(B * S, -1)), "final_norm": params["mtp"][0]["shared_head_norm"],
          "lm_head": params["lm_head"], "segments": [jax.tree.map(lambda a: a[None], params["mtp"][0]["layer"])]}
    want = np.asarray(forward(p1, one, jnp.arange(B * S, dtype=jnp.int32).reshape(B, S), moe_impl="dense"))
    assert got.shape == (B, S, cfg.vocab_size)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)

    # causal: changing the last next-token changes only the last position's logits
    ids2 = ids.copy()
    ids2[:, -1] = (ids2[:, -1] + 1) % cfg.vocab_size
    got2 = np.asarray(mtp_forward(params, cfg, hidden, jnp.asarray(ids2[:, 1:]), moe_impl="dense"))
    np.testing.assert_allclose(got2[:, :-1], got[:, :-1], rtol=1e-5, atol=1e-5)
    assert np.abs(got2[:, -1] - got[:, -1]).max() > 1e-3
