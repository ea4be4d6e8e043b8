"""Speculative decoding under tensor and data parallelism (docs/speculative.md): greedy output token for token that
without speculation, for each method, on 4 fake CPU devices (tests/sharding/run_spec.py, one subprocess a model;
both run at once).

- `deepseek_mtp` on the shipped default model (DeepSeek-V3 architecture, its trained MTP layer at index
  num_hidden_layers, so drafts are both accepted and rejected) under TP=2 with DP=2 x EP=4: the output is the
  one-device output without speculation, and the counters equal the one-device speculating run's (the same drafts
  accepted at the same positions: a sharded MTP that read or wrote its KV wrongly would draft otherwise).
- On a tiny V3 checkpoint saved by HF transformers with MTP weights added, the output is HF's greedy output with
  `ngram` under TP=2 (one rank) and with `draft_model` under DP=2 x EP=2. The draft (the target's own checkpoint,
  unsharded on the first device, every data-parallel rank's pages in its pool) has every draft accepted, so a
  rank's draft KV in another rank's pages would show.
Every run: no compile after warm-up, every rank's pages back in its pool; the MTP's KV is one more cache layer.
Pipeline parallelism is refused in one line before anything loads."""

from __future__ import annotations

import os

import pytest

from hf_models import build_hf_model, hf_greedy, save_hf_model, with_mtp_weights
from deepinfer_jax import LLM
from _runs import REPO, run_all

RUN_SPEC = os.path.join(REPO, "tests", "sharding", "run_spec.py")
DEFAULT = os.path.join(REPO, "deepinfer_jax", "assets", "default-model")
# 2x2ep: TP=2 and DP=2 (EP=4) at once; 2x1: tensor parallelism alone (one rank); 1x2ep: DP=2 x EP=2 (TP=1)
MTP_CASES = ["1x1:none", "1x1:deepseek_mtp", "2x2ep:deepseek_mtp"]
TINY_CASES = ["2x1:ngram", "1x2ep:draft_model"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF's model, its checkpoint with random MTP weights at index num_hidden_layers)."""
    model = build_hf_model("v3_grouped_noaux", num_nextn_predict_layers=1)
    absent = save_hf_model(model, str(tmp_path_factory.mktemp("spec_tp_absent")))
    return model, with_mtp_weights(absent, str(tmp_path_factory.mktemp("spec_tp_mtp")))


@pytest.fixture(scope="module")
def runs(tiny):
    return run_all({name: [RUN_SPEC, path, *cases]
                    for name, path, cases in (("default", DEFAULT, MTP_CASES), ("tiny", tiny[1], TINY_CASES))})


def _check_run(name, r, layers):
    assert r["compiles_after_warmup"] == 0, name
    assert all(u == 0.0 for u in r["kv_usage_after"]), name  # every rank's pages back in its pool
    assert r["kv_layers"] == layers, name
    assert sum(r["num_accepted_tokens_per_pos"]) == r["num_accepted_tokens"], name
    layout = name.split(":")[0]
    tp, dp = (int(x) for x in layout.removesuffix("ep").split("x"))
    assert r["mesh"] == (None if tp * dp == 1 else {"data": dp, "tensor": tp}), name
    assert len(r["kv_usage_after"]) == dp, name


def test_mtp_under_tensor_and_data_parallelism(runs):
    res = runs["default"]["cases"]
    base = res["1x1:none"]["tokens"]
    one = res["1x1:deepseek_mtp"]
    L = 4  # the default model's num_hidden_layers; its MTP's KV is layer L
    assert 0 < one["num_accepted_tokens"] < one["num_draft_tokens"]  # drafts accepted, and rejected
    for name in MTP_CASES[1:]:
        r = res[name]
        assert r["tokens"] == base, f"{name}: {r['tokens']} != {base}"
        _check_run(name, r, L + 1)
        counters = [r[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                   "num_accepted_tokens_per_pos")]
        assert counters == [one[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                             "num_accepted_tokens_per_pos")], name


def test_ngram_and_draft_model_under_tensor_and_data_parallelism(runs, tiny):
    res = runs["tiny"]
    want = [hf_greedy(tiny[0], p, n) for p, n in zip(res["prompts"], res["max_tokens"])]
    print("\n" + ", ".join(f"{n} {r['seconds']}s" for run in runs.values() for n, r in run["cases"].items()))
    for name in TINY_CASES:
        r = res["cases"][name]
        assert r["tokens"] == want, f"{name}: {r['tokens']} != {want}"
        _check_run(name, r, 3)
        assert r["num_draft_tokens"] > 0, name
        if name.endswith("draft_model"):  # the target as its own draft: every draft accepted
            assert r["num_accepted_tokens"] == r["num_draft_tokens"], name
        else:
            assert r["num_accepted_tokens"] > 0, name


def test_pipeline_parallelism_is_refused_naming_both_flags(tiny):
    with pytest.raises(ValueError, match="--speculative-config is not supported with --pipeline-parallel-size > 1"):
        LLM(tiny[1], pipeline_parallel_size=2, skip_tokenizer_init=True,
            speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1})
