"""`deepseek_mtp` speculation through the engine (docs/speculative.md): the checkpoint's MTP layer drafts on the
device. On the shipped default model (DeepSeek-V3 architecture, its trained MTP layer at index num_hidden_layers,
saved by our writer): greedy output token for token that of a dense forward's greedy decode, under chunked
prefill, prefix-cache hits and preemption; every step's drafts equal the dense MTP chain (`mtp_forward` over the
same prefix, its own output chained for drafts 2..K), so a wrong MTP KV anywhere is caught; seeded sampling
reproduces; counters; acceptance on chat prompts. On a tiny V3 checkpoint saved by HF transformers with MTP
tensors added: greedy output equals HF's. A checkpoint without MTP weights is refused in one line."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import build_hf_model, random_prompts, save_hf_model, with_mtp_weights
from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.models.deepseek import forward
from deepinfer_jax.models.mtp import mtp_forward

K = 3
DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "deepinfer_jax",
                       "assets", "default-model")
ARGS = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, page_size=8,
            progress=False, token_buckets=(32,))
L = 160  # the dense references' padded length


@pytest.fixture(scope="module")
def llm():
    # 33 pages of 8 tokens (the fewest max_model_len allows): the greedy test's prompts cannot all run at once, so
    # requests get preempted
    return LLM(DEFAULT, num_pages=33, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": K},
               **ARGS)


@pytest.fixture(scope="module")
def plain():
    # the speculating loop that fetches every step before planning the next (the default overlaps them:
    # test_spec_overlap.py), whose drafts the chain test follows step by step
    return LLM(DEFAULT, num_pages=33, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": K},
               spec_overlap=False, **ARGS)


def test_plan_counts_the_mtp_layers_cache_rows(llm):
    """`deepinfer plan --speculative-config` with deepseek_mtp: KV bytes a token those of the cache the runner
    allocated ([L + 1, pages, page_size, R + dr], the MTP layer's latents as layer L); without it, L layers'."""
    from deepinfer_jax.engine.plan import plan

    cache, layers = llm.engine.runner.kv_cache, llm.engine.cfg.num_hidden_layers
    allocated = cache.nbytes // (cache.shape[1] * cache.shape[2])
    sizes = dict(dtype="float32", page_size=8, max_model_len=256)
    assert plan(DEFAULT, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": K},
                **sizes).kv_bytes_per_token == allocated
    assert plan(DEFAULT, **sizes).kv_bytes_per_token * (layers + 1) == allocated * layers
    assert plan(DEFAULT, speculative_config={"method": "ngram", "num_speculative_tokens": K},
                **sizes).kv_bytes_per_token * (layers + 1) == allocated * layers  # n-gram drafts hold no cache
    with pytest.raises(ValueError, match="does not count a --speculative-config draft model"):
        plan(DEFAULT, speculative_config={"method": "draft_model", "model": DEFAULT, "num_speculative_tokens": K})


def test_start_up_fit_check_counts_the_mtp_layers_cache_rows():
    """serve's and LLM's fit check (`fit_problem`) counts the MTP layer's cache with deepseek_mtp: 0.03 GiB holds
    1,536 tokens of the default model's KV without it, not with it; an n-gram or draft-model config adds no rows."""
    from deepinfer_jax.engine.plan import fit_problem

    def problem(spec):
        return fit_problem(DEFAULT, (1, 1, False), "float32", None, "auto", 0.03, 0.9, 1536, page_size=8,
                           speculative_config=spec)

    assert problem(None) is None
    assert "does not fit" in problem(json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": K}))
    assert problem({"method": "ngram", "num_speculative_tokens": K}) is None
    assert problem({"method": "draft_model", "model": DEFAULT, "num_speculative_tokens": K}) is None


@functools.lru_cache(maxsize=None)
def _dense(cfg):
    """Jitted dense references at [B, L]: the target's logits and final-normed hidden states, and the MTP's
    logits and h'' (models/mtp.py mtp_forward) from given hidden states and next tokens."""
    target = jax.jit(lambda p, ids: forward(p, cfg, ids, return_hidden=True))
    mtp = jax.jit(lambda p, h, nxt: mtp_forward(p, cfg, h, nxt, return_hidden=True))
    return target, mtp


def _greedy_reference(llm, prompts, n):
    """Greedy continuations by the dense forward (no cache, no speculation), all prompts in one batch."""
    eng = llm.engine
    target, _ = _dense(eng.cfg)
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        ids = np.zeros((len(seqs), L), np.int32)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
        logits = np.asarray(target(eng.runner.params, jnp.asarray(ids))[0])
        for i, s in enumerate(seqs):
            s.append(int(logits[i, len(s) - 1].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def _gen(llm, prompts, **kw):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**kw))


def _prompts():
    """Random prompts, one longer than the step's token budget (chunked prefill), two sharing a 44-token prefix
    (prefix-cache hits on its 5 full pages)."""
    rng = np.random.default_rng(5)
    shared = rng.integers(2, 2000, 44).tolist()
    return [shared + [9, 9, 9], shared + rng.integers(2, 2000, 6).tolist(), rng.integers(2, 2000, 90).tolist()] + \
        random_prompts(31, [5, 17, 40, 23], 2000)


def test_greedy_output_is_that_without_speculation(llm):
    prompts = _prompts()
    want = _greedy_reference(llm, prompts, 24)
    eng = llm.engine
    before = eng.scheduler.num_preemptions, eng.scheduler.kv_cache_manager.prefix_cache_hits
    got = _gen(llm, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in got] == want
    assert eng.scheduler.num_preemptions > before[0] and eng.scheduler.kv_cache_manager.prefix_cache_hits > before[1]
    stats = eng.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # the MTP's drafts were accepted, and rejected
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert stats.num_draft_tokens <= K * stats.num_drafts
    assert eng.runner.compiles_after_warmup == 0
    assert eng.scheduler.kv_cache_manager.usage == 0.0  # every page back in the pool
    assert eng.spec_overlap and eng.num_overlapped_steps > 0  # the default: the overlapped loop


def _check_drafts(llm, ids, drafts):
    """The engine's drafts after the tokens `ids` (its last not yet computed by the target) against the dense
    chain: draft 1 the MTP's argmax at position len - 2 over the target's hidden states and the next tokens;
    draft k + 1 with the MTP's own output h'' at the previous position as the hidden state and draft k as the
    token there. Near-ties allowed (the draft's logit within 1e-4 of the maximum)."""
    eng = llm.engine
    target, mtp = _dense(eng.cfg)
    p, n = eng.runner.params, len(ids)
    pad = np.zeros(L, np.int32)
    pad[: n - 1] = ids[:-1]
    _, hidden = target(p, jnp.asarray(pad[None]))
    hidden = np.array(hidden[0])  # [L, D], writable
    nxt = np.zeros(L, np.int32)
    nxt[: n - 1] = ids[1:]
    for k, d in enumerate(drafts):
        logits, h2 = mtp(p, jnp.asarray(hidden[None]), jnp.asarray(nxt[None]))
        row = np.asarray(logits[0, n - 2 + k])
        assert row[d] >= row.max() - 1e-4, (n, k, d, int(row.argmax()))
        hidden[n - 1 + k] = np.asarray(h2[0, n - 2 + k])  # the chain: h'' as the next position's hidden state
        nxt[n - 1 + k] = d


def test_drafts_are_the_dense_mtp_chain(plain):
    """Step by step, one request after another: the first fills the prefix cache, the second hits it (5 full
    pages) and is prefilled in chunks; after every step each request's drafts equal the dense chain's."""
    llm = plain
    eng = llm.engine
    assert not eng.spec_overlap
    rng = np.random.default_rng(8)
    shared = rng.integers(2, 2000, 44).tolist()
    for i, prompt in enumerate([shared + [5, 6], shared + rng.integers(2, 2000, 40).tolist()]):
        hits = eng.scheduler.kv_cache_manager.prefix_cache_hits
        rid = f"chain-{i}"
        eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
        checked = 0
        while eng.has_unfinished_requests():
            eng.step()
            for req in eng.scheduler.running:
                rec = eng.mtp_proposer._drafts.get(req.request_id)
                if rec is not None and rec[0] == req.num_tokens:
                    _check_drafts(llm, req.all_token_ids, rec[1])
                    checked += 1
        assert checked >= 4
        if i:
            assert eng.scheduler.kv_cache_manager.prefix_cache_hits > hits


def test_seeded_sampling_reproduces_and_counters(llm):
    prompts = _prompts()[:3]
    kw = dict(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in _gen(llm, prompts, **kw)]
    again = [o.outputs[0].token_ids for o in _gen(llm, prompts[::-1], **kw)][::-1]  # another batch order
    assert first == again and all(len(t) == 12 for t in first)
    s = llm.engine.spec_stats
    assert s.num_drafts > 0 and s.mean_acceptance_length == 1 + s.num_accepted_tokens / s.num_drafts
    assert list(s.num_accepted_tokens_per_pos) == sorted(s.num_accepted_tokens_per_pos, reverse=True)
    assert llm.engine.runner.compiles_after_warmup == 0


def test_default_model_accepts_its_mtp_drafts_on_chat(llm):
    import dataclasses

    msgs = [[{"role": "user", "content": c}] for c in
            ("Hello! How are you today?", "Can you tell me a fun fact?", "What should I cook for dinner?",
             "Thanks for your help!")]
    before = dataclasses.replace(llm.engine.spec_stats)
    llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=48))
    s = llm.engine.spec_stats
    drafts, accepted = s.num_drafts - before.num_drafts, s.num_accepted_tokens - before.num_accepted_tokens
    mean = 1 + accepted / drafts
    print(f"default model, deepseek_mtp K={K}: mean acceptance length {mean:.2f} over {drafts} drafts")
    assert mean > 1.5


def test_hf_checkpoint_with_mtp_weights_and_refusal_without(tmp_path_factory, hf_greedy):
    model = build_hf_model("v3_grouped_noaux", num_nextn_predict_layers=1)
    absent = save_hf_model(model, str(tmp_path_factory.mktemp("mtp_absent")))  # transformers drops MTP weights
    with pytest.raises(ValueError, match="'deepseek_mtp' needs a checkpoint with MTP weights"):
        LLM(absent, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1}, skip_tokenizer_init=True,
            **ARGS)
    present = with_mtp_weights(absent, str(tmp_path_factory.mktemp("mtp_present")))
    # K = 1: the MTP's first pass alone (no chained passes); one bucket of 16 tokens
    spec = LLM(present, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1},
               skip_tokenizer_init=True, **{**ARGS, "max_num_seqs": 4, "max_num_batched_tokens": 16,
                                            "token_buckets": (16,)})
    assert spec.engine.cfg.has_mtp and spec.engine.runner.kv_cache.shape[0] == spec.engine.cfg.num_hidden_layers + 1
    prompts = random_prompts(12, [7, 40, 19], 320)
    got = _gen(spec, prompts, temperature=0.0, max_tokens=10, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in got] == [hf_greedy(model, p, 10) for p in prompts]
    assert spec.engine.spec_stats.num_draft_tokens > 0 and spec.engine.runner.compiles_after_warmup == 0
