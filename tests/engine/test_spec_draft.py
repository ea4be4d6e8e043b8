"""Speculative decoding with a draft model (`draft_model`, engine/spec_draft.py): greedy output token for token as
without speculation, with the target as its own draft (every draft accepted) and with a random dense draft of the
same vocabulary (drafts rejected), under chunked prefill, prefix caching and a pool small enough to preempt; seeded
sampling reproduces; refusals at start; no recompile after warm-up and no page leak."""

from __future__ import annotations

import os

import pytest

from hf_models import build_dense_hf_model, save_hf_model
from deepinfer_jax import LLM, SamplingParams

K = 3
ARGS = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
            page_size=8, progress=False, token_buckets=(16, 64))


@pytest.fixture(scope="module")
def path(hf_case):
    return hf_case("v3_grouped_noaux")[1]


@pytest.fixture(scope="module")
def plain(path):
    # test_speculative.py's and test_engine_features.py's engine (its programs come from the session's program cache
    # when those ran first)
    return LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=512, max_num_seqs=16,
               max_num_batched_tokens=256, page_size=8, progress=False)


@pytest.fixture(scope="module")
def dense_draft(tmp_path_factory):
    """A random Qwen3 model with the target's vocabulary (320 ids): its drafts are mostly rejected."""
    return save_hf_model(build_dense_hf_model("qwen3", seed=3, vocab_size=320, num_hidden_layers=2),
                         str(tmp_path_factory.mktemp("qwen3-draft")))


def _draft(path, draft, **kw):
    # 40 pages of 8 tokens: the prompts below cannot all run at once, so requests get preempted
    return LLM(path, num_pages=40, speculative_config={"method": "draft_model", "model": draft,
                                                       "num_speculative_tokens": K}, **{**ARGS, **kw})


def _prompts():
    """Random prompts; one longer than the step's token budget (chunked prefill), two sharing a prefix (prefix cache
    hits)."""
    from hf_models import random_prompts

    shared = random_prompts(4, [24], 320)[0]
    return [shared + [9, 9, 9], shared + [5, 7]] + random_prompts(31, [90, 5, 17, 40, 33, 12], 320)


def _gen(llm, prompts, **kw):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**kw))


def _check_engine(llm):
    eng = llm.engine
    assert eng.runner.compiles_after_warmup == 0 and eng.drafter.runner.compiles_after_warmup == 0
    assert eng.scheduler.kv_cache_manager.usage == 0.0  # every page back in the pool


def test_target_as_its_own_draft_accepts_every_draft(plain, path):
    prompts = _prompts()
    want = [o.outputs[0].token_ids for o in _gen(plain, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)]
    llm = _draft(path, path)
    got = _gen(llm, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in got] == want
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0 and eng.scheduler.kv_cache_manager.prefix_cache_hits > 0
    _check_engine(llm)


def test_a_random_dense_draft_is_rejected_yet_the_output_is_the_same(plain, path, dense_draft):
    prompts = _prompts()
    llm = _draft(path, dense_draft)
    want = [o.outputs[0].token_ids for o in _gen(plain, prompts, temperature=0.0, max_tokens=20, ignore_eos=True)]
    got = _gen(llm, prompts, temperature=0.0, max_tokens=20, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in got] == want
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert llm.engine.scheduler.num_preemptions > 0
    # seeded sampling at temperature > 0 reproduces, n > 1 children differ
    kw = dict(temperature=1.0, seed=11, max_tokens=12, n=3, ignore_eos=True)
    first = [tuple(c.token_ids) for c in _gen(llm, prompts[:1], **kw)[0].outputs]
    again = [tuple(c.token_ids) for c in _gen(llm, prompts[:1], **kw)[0].outputs]
    assert first == again and len(set(first)) > 1 and all(len(t) == 12 for t in first)
    _check_engine(llm)


def test_refusals_at_start(path, hf_case, tmp_path):
    spec = lambda d: {"method": "draft_model", "model": d, "num_speculative_tokens": 2}  # noqa: E731
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="is not a directory"):
        LLM(path, speculative_config=spec(missing), **ARGS)
    other = hf_case("llama_tp")[1]  # 336 ids
    with pytest.raises(ValueError, match="vocab_size 336 differs from the target's 320"):
        LLM(path, speculative_config=spec(other), **ARGS)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
        LLM(path, speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 0}, **ARGS)


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    """The default model's directory with two tokens' ids swapped in its tokenizer: the same vocabulary size, another
    tokenizer."""
    import json
    import shutil

    asset = os.path.join(os.path.dirname(__file__), "..", "..", "deepinfer_jax", "assets", "default-model")
    draft = str(tmp_path / "draft")
    shutil.copytree(asset, draft)
    with open(os.path.join(draft, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(os.path.join(draft, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    with pytest.raises(ValueError, match="tokenizer differs from the target's: id 100"):
        LLM(asset, dtype="float32", max_model_len=256, progress=False,
            speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2})
