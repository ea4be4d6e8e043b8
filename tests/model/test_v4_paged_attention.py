"""DeepSeek-V4's paged attention (models/v4_paged.py) against the whole-sequence reference (`v4_forward`): a step of
two prefills then a decode step over the per-group cache give each sequence's last logits, whether the queries
attend in one block or in blocks of a few tokens (the memory-bounded form, last block padded), and with the
indexer's scores from V3.2's paged kernel through the layout shim (`attn_impl` "pallas_interpret")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.config_v4 import v4_cache_groups
from deepinfer_jax.models import v4_paged
from deepinfer_jax.models.cache import StepMetadata

# contexts past the window (8) and several CSA (4) / HCA (8) windows; pages of 8 rows, the state groups' own of 4
PS, LENS, MAX_LEN = 8, (37, 22), 48


@pytest.fixture(scope="module")
def v4():
    from hf_models_v4 import V4_TINY

    from deepinfer_jax.weights.random_init import random_params

    cfg = ModelConfig.from_hf_dict(dict(V4_TINY, model_type="deepseek_v4", num_hidden_layers=2,
                                        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                                        mlp_layer_types=["moe", "moe"]))  # the two kinds with compressed rows
    rng = np.random.default_rng(7)

    def draw(path, leaf):  # random_params' ranges, drawn in numpy (its jitted drawer compiles for ~30 s)
        name = jax.tree_util.keystr(path)
        if jnp.issubdtype(leaf.dtype, jnp.integer):  # hash routing's token -> experts table
            return jnp.asarray(rng.integers(0, cfg.v4.n_routed_experts, leaf.shape), leaf.dtype)
        lo, hi = (0.9, 1.1) if "norm" in name else (0.0, 0.1) if "correction_bias" in name else (-0.3, 0.3)
        return jnp.asarray(rng.uniform(lo, hi, leaf.shape), leaf.dtype)

    params = jax.tree_util.tree_map_with_path(draw, jax.eval_shape(lambda: random_params(cfg, jnp.float32)))
    seqs = [rng.integers(2, cfg.vocab_size, n + 1) for n in LENS]  # the prompt, then one decoded token
    ids = np.zeros((len(LENS), max(LENS) + 1), np.int32)
    for k, t in enumerate(seqs):
        ids[k, : len(t)] = t  # right padding changes no earlier position (causal)
    whole = np.asarray(jax.jit(lambda p, t: v4_paged.forward(p, cfg, t))(params, jnp.asarray(ids)))
    want_prefill = np.stack([whole[k, n - 1] for k, n in enumerate(LENS)])
    want_decode = np.stack([whole[k, n] for k, n in enumerate(LENS)])
    return cfg, params, seqs, want_prefill, want_decode


def _tables(cfg):
    """Per group (a pool each), distinct pages for each sequence: [S, pages of MAX_LEN] tables, page 0 null."""
    tables = []
    for g in v4_cache_groups(cfg.v4, 1):
        width = -(-(MAX_LEN // g.tokens_per_row) // g.rows_per_page(PS))
        tables.append(np.arange(1, 1 + len(LENS) * width, dtype=np.int32).reshape(len(LENS), width))
    return tables


def _meta(cfg, tables, ids, pos, seq, last):
    groups = []
    for g, table in zip(v4_cache_groups(cfg.v4, 1), tables):
        r, w, rows = g.tokens_per_row, pos // g.tokens_per_row, g.rows_per_page(PS)
        real = table[seq, w // rows] * rows + w % rows
        groups.append((jnp.asarray(table), jnp.asarray(np.where((pos + 1) % r == 0, real, 0), jnp.int32)))
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return StepMetadata(i32(ids), i32(pos), i32(seq), i32(np.zeros_like(pos)), jnp.asarray(tables[0]), i32(last),
                        groups=tuple(groups))


def _run(v4, attn_impl):
    cfg, params, seqs, _, _ = v4
    tables = _tables(cfg)
    cache = tuple(jnp.zeros((t.size + 1, len(g.layers) * g.rows_per_page(PS) * g.row_bytes), jnp.float32)
                  for g, t in zip(v4_cache_groups(cfg.v4, 1), tables))
    # a fresh function per run: its trace reads v4_paged.TOKEN_BLOCK as the test set it
    fn = jax.jit(lambda p, c, m: v4_paged.forward_paged(p, cfg, c, m, attn_impl=attn_impl))
    ids = np.concatenate([s[:-1] for s in seqs])
    pos = np.concatenate([np.arange(n) for n in LENS])
    seq = np.concatenate([np.full(n, k) for k, n in enumerate(LENS)])
    prefill, cache = fn(params, cache, _meta(cfg, tables, ids, pos, seq, np.cumsum(LENS) - 1))
    step = _meta(cfg, tables, [s[-1] for s in seqs], np.array(LENS), np.arange(len(LENS)), np.arange(len(LENS)))
    decode, _ = fn(params, cache, step)
    return np.asarray(prefill), np.asarray(decode)


@pytest.mark.parametrize("attn_impl", ["reference", "pallas_interpret"])
def test_paged_attention_matches_whole_sequence(v4, attn_impl, monkeypatch):
    monkeypatch.setattr(v4_paged, "TOKEN_BLOCK", 16)  # the prefill step's 59 queries in 4 blocks, the last padded
    prefill, decode = _run(v4, attn_impl)
    np.testing.assert_allclose(prefill, v4[3], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(decode, v4[4], atol=1e-4, rtol=1e-4)


def test_layers_make_their_weights_derived_temporaries_in_turn():
    """Each layer's weights pass a barrier with the previous layer's streams, so what XLA derives from them (the FP4
    experts and FP8 linears dequantized on the XLA paths) is made one layer at a time: the compiled prefill step's
    temporaries (XLA's memory analysis, CPU) grow by well under a layer's dequantized experts a layer. Without the
    barrier XLA made them up front, and a V4 step's temporaries grew by about that much a layer."""
    from hf_models_v4 import V4_TINY

    from deepinfer_jax.weights.release_random import pending_release_params, release_quant

    def temp_bytes(layers):
        hf = dict(V4_TINY, model_type="deepseek_v4", hidden_size=256, moe_intermediate_size=256, n_routed_experts=16,
                  num_hidden_layers=layers, layer_types=["compressed_sparse_attention"] * layers,
                  mlp_layer_types=["moe"] * layers, expert_dtype="fp4",
                  quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                       "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
        cfg = ModelConfig.from_hf_dict(hf)
        params = pending_release_params(cfg, release_quant(hf, cfg), jnp.float32).abstract
        tables = _tables(cfg)
        cache = tuple(jax.ShapeDtypeStruct((t.size + 1, len(g.layers) * g.rows_per_page(PS) * g.row_bytes),
                                           jnp.float32) for g, t in zip(v4_cache_groups(cfg.v4, 1), tables))
        n = 32
        meta = _meta(cfg, tables, np.ones(n, int), np.arange(n), np.zeros(n, int), [n - 1])
        fn = jax.jit(lambda p, c, m: v4_paged.forward_paged(p, cfg, c, m, moe_impl="ragged"), donate_argnums=1)
        return fn.lower(params, cache, meta).compile().memory_analysis().temp_size_in_bytes, cfg

    (few, cfg), (many, _) = temp_bytes(2), temp_bytes(6)
    experts = 3 * cfg.v4.n_routed_experts * cfg.v4.hidden_size * cfg.v4.moe_intermediate_size * 4  # fp32, a layer
    assert (many - few) / 4 < experts / 4, (few, many, experts)
