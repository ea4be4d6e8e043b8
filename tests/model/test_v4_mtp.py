"""DeepSeek-V4's MTP block (DeepSeek's MTPBlock): loaded from DeepSeek's released names (float and FP8), and the
paged MTP of `deepseek_mtp` speculation (models/v4_mtp.py) against the whole-sequence reference
(models/deepseek_v4.py `v4_mtp_forward`, and the block run over the chained input for the second draft). HF
transformers drops the MTP block, so the reference is this project's own, built from the inference reference's
MTPBlock.forward; a checkpoint that declares MTP without its tensors loads without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.config_v4 import v4_cache_groups, with_mtp_cache
from deepinfer_jax.models import v4_paged
from deepinfer_jax.models.cache import StepMetadata
from deepinfer_jax.models.deepseek_v4 import v4_block, v4_mtp_forward, v4_mtp_input, v4_mtp_logits, v4_streams
from deepinfer_jax.models.layers import weight
from deepinfer_jax.models.v4_mtp import v4_mtp_propose
from deepinfer_jax.weights.name_table_v4 import load_v4_checkpoint, v4_checkpoint_config

PS, MAX_LEN = 4, 40


@pytest.fixture(scope="module")
def dirs(v4_mtp_dirs):
    """(float dir with MTP, its FP8 / FP4 release, the HF save that declares MTP without it)."""
    return v4_mtp_dirs[1:]


@pytest.fixture(scope="module")
def model(dirs):
    cfg = v4_checkpoint_config(ModelConfig.from_model_dir(dirs[0]), dirs[0])
    _, params = load_v4_checkpoint(dirs[0], jnp.float32, cfg.v4, quantization="none")
    return cfg, params


def test_declared_without_tensors_loads_without_mtp(dirs):
    bare = dirs[2]
    cfg = ModelConfig.from_model_dir(bare)
    assert cfg.num_nextn_predict_layers == 1  # declared
    cfg = v4_checkpoint_config(cfg, bare)
    assert (cfg.num_nextn_predict_layers, cfg.v4.num_nextn_predict_layers, cfg.has_mtp) == (0, 0, False)
    _, params = load_v4_checkpoint(bare, jnp.float32)
    assert "mtp" not in params


def test_released_mtp_loads_fp8_and_dequantizes_to_the_float_block(dirs, model):
    from deepinfer_jax.models.quant import is_fp8

    _, params = model
    _, rel = load_v4_checkpoint(dirs[1], jnp.float32)
    mp, mr = params["mtp"][0], rel["mtp"][0]
    assert is_fp8(mr["e_proj"]) and is_fp8(mr["layer"]["attn"]["q_a_proj"])
    for path in (("e_proj",), ("h_proj",), ("layer", "attn", "kv_proj"), ("layer", "moe", "shared", "down")):
        a, b = mp, mr
        for k in path:
            a, b = a[k], b[k]
        # FP8 with block scales: the released bytes dequantize to the float weights within e4m3's step
        np.testing.assert_allclose(np.asarray(weight(b, jnp.float32)), np.asarray(a), rtol=0.07, atol=1e-3)
    np.testing.assert_array_equal(np.asarray(mr["hc_head"]["fn"]), np.asarray(mp["hc_head"]["fn"]))


def test_convert_writes_the_mtp_block(dirs, model, tmp_path):
    from deepinfer_jax.weights.convert import convert
    from deepinfer_jax.weights.loader import load_model

    _, params = model
    dst = str(tmp_path / "conv")
    meta = convert(dirs[0], dst, "float32", "none", progress=False)
    assert meta["num_nextn_predict_layers"] == 1
    cfg_c, p_c = load_model(dst, jnp.float32, progress=False)
    assert cfg_c.has_mtp
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p_c["mtp"], params["mtp"])
    # `deepinfer plan` counts the MTP block where the files hold it, HF directory or converted alike
    from deepinfer_jax.engine.plan import plan

    hf, conv, bare = (plan(d, dtype="float32").weight_bytes_per_device for d in (dirs[0], dst, dirs[2]))
    assert hf == conv > bare


def _meta(cfg, ids, pos, last, next_ids):
    groups = []
    for g in v4_cache_groups(cfg.v4, 1):
        width = -(-(MAX_LEN // g.tokens_per_row) // PS)
        table = np.arange(1, 1 + width, dtype=np.int32)[None, :]
        w = pos // g.tokens_per_row
        slots = np.where((pos + 1) % g.tokens_per_row == 0, table[0, w // PS] * PS + w % PS, 0)
        groups.append((jnp.asarray(table), jnp.asarray(slots, jnp.int32)))
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return StepMetadata(i32(ids), i32(pos), i32(np.zeros_like(pos)), i32(np.zeros_like(pos)), groups[0][0],
                        i32(last), groups=tuple(groups), next_token_ids=i32(next_ids))


def test_paged_mtp_drafts_are_the_reference_blocks(model):
    """One prefill step of a prompt past the window, then the MTP's K = 2 drafts: draft 1 is the argmax of the
    whole-sequence MTP reference (`v4_mtp_forward`) at the last position with the sampled token next; draft 2
    that of the block over the same inputs plus one position (its own output and draft 1), as the reference chains
    it."""
    cfg, params = model
    cfg = with_mtp_cache(cfg)
    v4, L = cfg.v4, cfg.v4.num_hidden_layers
    assert v4_cache_groups(v4, 1)[0].layers == tuple(range(L + 1))  # the MTP layer's rows in `sliding`
    prompt = np.random.default_rng(5).integers(2, v4.vocab_size, 19)
    n = len(prompt)
    cache = tuple(jnp.zeros((-(-(MAX_LEN // g.tokens_per_row) // PS) + 1, len(g.layers) * PS * g.row_bytes),
                            jnp.float32) for g in v4_cache_groups(v4, 1))
    meta = _meta(cfg, prompt, np.arange(n), [n - 1], [-1])

    @jax.jit
    def step(params, cache, meta):
        logits, cache, streams = v4_paged.forward_paged(params, cfg, cache, meta, return_hidden=True)
        sampled = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [1]
        accepted = jnp.zeros((3,), bool)  # K = 2: rows of drafts none were given
        drafts, _ = v4_mtp_propose(params, cfg, cache, meta, streams, jnp.repeat(sampled, 3), accepted, 2)
        return sampled, drafts

    sampled, drafts = jax.device_get(step(params, cache, meta))
    mp = params["mtp"][0]

    @jax.jit
    def reference(params, tokens, d1):
        streams, _ = v4_streams(v4, params, tokens[:n])
        x1 = v4_mtp_input(v4, mp, params["embed"], streams, tokens[1:])
        out1, _ = v4_block(v4, L, mp["layer"], x1, tokens[1:], jnp.arange(n))
        # the chained pass: the block over positions 0..n (position n: its own output at n - 1 and draft 1)
        x2 = jnp.concatenate([x1, v4_mtp_input(v4, mp, params["embed"], out1[n - 1:n], d1)])
        out2, _ = v4_block(v4, L, mp["layer"], x2, jnp.concatenate([tokens[1:], d1]), jnp.arange(n + 1))
        return v4_mtp_forward(v4, params, tokens)[n - 1], v4_mtp_logits(v4, params, out2[n:])[0]

    tokens = jnp.asarray(np.append(prompt, sampled[0]), jnp.int32)
    ref1, ref2 = jax.device_get(reference(params, tokens, jnp.asarray(drafts[0, :1], jnp.int32)))
    assert drafts[0, 0] == np.argmax(ref1) and drafts[0, 1] == np.argmax(ref2)
