"""Checkpoints that every layout must load and serve: a vocabulary that tensor parallelism does not divide
(embed / lm_head padded to a multiple of 64 x TP, the padding never sampled), and a DeepSeek-V3 config
declaring num_nextn_predict_layers: 1 with the MTP weights absent (HF transformers' save drops them; MTP is
then absent, `has_mtp` False) or present (`has_mtp` True). Greedy tokens equal HF's in fp32; on every layout the
load assembled on the host (CPU devices: hf_loader.host_assembly) equals the in-place device writes a GPU mesh's
load makes. 8 fake CPU devices, one subprocess per checkpoint (tests/sharding/run_case.py), both at once.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from hf_models import build_hf_model, hf_greedy, read_tensors, rewrite_checkpoint, save_hf_model
from _runs import REPO, run_all

RUN_CASE = os.path.join(REPO, "tests", "sharding", "run_case.py")
VOCAB = 317  # odd: TP = 2, 4, 8 pad it to 384, 512, 512
EVERY_LAYOUT = ["2x1", "4x1", "4x1ep", "2x2", "2x2ep", "2x4ep", "4x2ep", "1x8ep"]
RUNS = {  # checkpoint -> layouts served (greedy) and layouts only loaded
    "mtp_absent": ["1x1", "2x1", "2x2ep"] + [f"{x}:load" for x in EVERY_LAYOUT],
    "mtp_present": ["2x2ep"] + [f"{x}:load" for x in EVERY_LAYOUT],
}


def _with_mtp_weights(src: str, dst: str) -> str:
    """`src` plus random weights for its declared MTP layer, named as DeepSeek's checkpoints name them."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.weights.name_table import expected_tensors

    cfg = ModelConfig.from_model_dir(src)
    tensors = read_tensors(src)
    rng = np.random.default_rng(3)
    for rule in expected_tensors(cfg):
        if rule.path[0] == "mtp" and rule.hf_name not in tensors:
            tensors[rule.hf_name] = (1.0 + 0.1 * rng.standard_normal(rule.hf_shape)).astype(np.float32)
    pre = f"model.layers.{cfg.num_hidden_layers}"
    tensors[f"{pre}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors[f"{pre}.shared_head.head.weight"] = tensors["lm_head.weight"].copy()
    return rewrite_checkpoint(src, dst, tensors)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    model = build_hf_model("v3_flat_plain_rope", vocab_size=VOCAB, num_nextn_predict_layers=1)
    absent = save_hf_model(model, str(tmp_path_factory.mktemp("mtp_absent")))
    present = _with_mtp_weights(absent, str(tmp_path_factory.mktemp("mtp_present")))
    return model, {"mtp_absent": absent, "mtp_present": present}


@pytest.fixture(scope="module")
def runs(checkpoints):
    _, dirs = checkpoints
    return run_all({k: [RUN_CASE, dirs[k], *layouts] for k, layouts in RUNS.items()})


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_every_layout_loads_and_serves_hf_tokens(checkpoints, runs, kind):
    model, _ = checkpoints
    res = runs[kind]
    want = [hf_greedy(model, p, n) for p, n in zip(res["prompts"], res["max_tokens"])]
    for name, r in res["layouts"].items():
        layout = name.removesuffix(":load")
        tp = int(layout.split("x")[0])
        assert r["has_mtp"] == (kind == "mtp_present"), name
        assert r["param_vocab"] == (VOCAB if tp == 1 else -(-VOCAB // (64 * tp)) * 64 * tp), name
        if name.endswith(":load"):
            assert r["on_mesh"], name
            assert r["embed_spec"][0] == "tensor", name  # the padded vocab is split, not replicated
            # the load assembled on the host (as every engine here loads) and a GPU mesh's, through in-place
            # device writes: the same leaves, bit for bit
            assert r["writes"][0] == 0 and r["writes"][1] > 0 and r["device_updates_equal"], (name, r["writes"])
        else:
            assert r["tokens"] == want, f"{kind} {name}"
            assert all(t < VOCAB for seq in r["tokens"] for t in seq)


def test_collectives_are_the_predicted_ones(checkpoints, runs):
    """The compiled steps' collectives (kind, result shape) are exactly those sharding/comm.py predicts, for the
    layout of DP = 2 x EP = 4 with TP = 2 (vocab padded to 384): the prediction benchmarks/comm_volume.py prints
    for the GPU runs rests on this."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.sharding import ParallelConfig
    from deepinfer_jax.sharding.comm import step_collectives

    _, dirs = checkpoints
    r = runs["mtp_absent"]["layouts"]["2x2ep"]
    cfg = ModelConfig.from_model_dir(dirs["mtp_absent"]).with_vocab_multiple(128)
    want = sorted({(c.kind, c.shape) for c in step_collectives(cfg, ParallelConfig(2, 2, True), r["bucket"], r["seq_rows"], 4)})
    got = sorted((k, tuple(d)) for k, d in r["collectives"])
    assert got == want, f"compiled {got}, predicted {want}"


def test_padded_vocab_never_sampled_nor_in_logprobs():
    """Padding columns are dropped from the logits (models/deepseek.py _logits): with the lm_head's padding
    columns set to a huge value, the logits still have vocab_size columns and equal the unpadded model's."""
    import jax.numpy as jnp

    from deepinfer_jax.models.deepseek import _logits
    from hf_models import COMMON, CASES
    from deepinfer_jax.config import ModelConfig

    cfg = ModelConfig.from_hf_dict({**COMMON, **CASES["v3_flat_plain_rope"], "vocab_size": VOCAB})
    padded = cfg.with_vocab_multiple(128)
    assert padded.param_vocab_size == 384 and cfg.with_vocab_multiple(VOCAB).padded_vocab_size == 0
    rng = np.random.default_rng(0)
    D = cfg.hidden_size
    head = rng.standard_normal((D, VOCAB)).astype(np.float32)
    params = {"final_norm": jnp.ones((D,)), "lm_head": jnp.asarray(head)}
    params_p = {"final_norm": jnp.ones((D,)),
                "lm_head": jnp.asarray(np.concatenate([head, np.full((D, 384 - VOCAB), 1e4, np.float32)], 1))}
    h = jnp.asarray(rng.standard_normal((5, D)).astype(np.float32))
    want, got = _logits(params, cfg, h), _logits(params_p, padded, h)
    assert got.shape == (5, VOCAB)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
