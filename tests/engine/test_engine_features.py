"""Engine behaviour beyond greedy: seeds, n, stop tokens, min_tokens, logprobs, aborts, bad input,
and the recompile guard."""

from __future__ import annotations

import numpy as np
import pytest

from hf_models import random_prompts
from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.runner.inputs import HostStep, build_metadata, build_sampling


@pytest.fixture(scope="module")
def llm(hf_case):
    """test_llm_greedy.py's engine of this model (one program cache entry for both)."""
    _, path = hf_case("v3_grouped_noaux")
    return LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=512, max_num_seqs=16,
               max_num_batched_tokens=256, page_size=8, progress=False)


def _gen(llm, prompts, **kw):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**kw))


def test_seed_reproduces_across_batch_compositions(llm):
    p = random_prompts(20, [12], 320)[0]
    others = random_prompts(21, [5, 40, 3], 320)
    alone = _gen(llm, [p], temperature=1.0, seed=1234, max_tokens=12)[0].outputs[0].token_ids
    batch = llm.generate([{"prompt_token_ids": q} for q in [others[0], p, others[1], others[2]]],
                         [SamplingParams(temperature=1.0, max_tokens=12)] * 1
                         + [SamplingParams(temperature=1.0, seed=1234, max_tokens=12)]
                         + [SamplingParams(temperature=0.8, max_tokens=7)] * 2)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = _gen(llm, [p], temperature=1.0, seed=99, max_tokens=12)[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_children_share_prompt_and_differ(llm):
    p = random_prompts(22, [30], 320)[0]
    out = _gen(llm, [p], n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) > 1 and all(len(s) == 10 for s in seqs)
    again = _gen(llm, [p], n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == seqs


def test_stop_token_ids_and_min_tokens(llm):
    p = random_prompts(23, [9], 320)[0]
    free = _gen(llm, [p], temperature=0.0, max_tokens=12, ignore_eos=True)[0].outputs[0].token_ids
    stop_at = free[3]
    first = free.index(stop_at)
    out = _gen(llm, [p], temperature=0.0, max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True)[0].outputs[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens suppresses the stop id until enough tokens are out.
    late = _gen(llm, [p], temperature=0.0, max_tokens=12, min_tokens=first + 2, stop_token_ids=[stop_at],
                ignore_eos=True)[0].outputs[0]
    assert stop_at not in late.token_ids[: first + 2]


def test_min_tokens_holds_back_at_most_the_samplers_width(llm):
    """min_tokens holds the stop ids and EOS back in the sampler, Shapes.max_suppress of them at most: LLM.generate
    refuses more in a line (as the server does, through the same LLMEngine check), not letting the rest through."""
    cap, eos = llm.engine.shapes.max_suppress, len(llm.engine.eos_token_ids)
    stops = list(range(100, 101 + cap - eos))  # with the EOS ids, one more than the sampler holds back
    p = {"prompt_token_ids": random_prompts(25, [5], 320)[0]}
    with pytest.raises(ValueError, match=rf"^with min_tokens, at most {cap} stop_token_ids and EOS ids can be held "
                                         rf"back; this request has {cap + 1}$"):
        llm.generate(p, SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=stops))
    assert not llm.engine.has_unfinished_requests()
    # refused after a prompt it accepted: the call leaves nothing queued behind it
    with pytest.raises(ValueError, match="^with min_tokens"):
        llm.generate([p, p], [SamplingParams(max_tokens=3),
                              SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=stops)])
    assert not llm.engine.has_unfinished_requests()
    # ignore_eos frees the EOS ids' places (when there are any), and without min_tokens nothing is held back
    ok = [SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=stops[:cap - eos], ignore_eos=True),
          SamplingParams(max_tokens=3, stop_token_ids=stops)]
    held, free = llm.generate([p, p], ok)
    assert len(held.outputs[0].token_ids) >= 2 and free.outputs[0].finish_reason in ("stop", "length")


def test_logprobs_are_raw_log_softmax(llm, hf_case):
    import torch

    model, _ = hf_case("v3_grouped_noaux")
    p = random_prompts(24, [15], 320)[0]
    out = _gen(llm, [p], temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True)[0].outputs[0]
    assert len(out.logprobs) == 3
    with torch.no_grad():
        logits = model(torch.tensor([p + out.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(p) - 1: len(p) + 2].numpy()
    for step, entry in enumerate(out.logprobs):
        tok = out.token_ids[step]
        assert entry[tok].rank == 1
        assert entry[tok].logprob == pytest.approx(ref[step, tok], abs=1e-4)
        top5 = np.argsort(-ref[step])[:5]
        assert set(top5.tolist()) <= set(entry)
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)))


def test_abort_frees_blocks(llm):
    eng = llm.engine
    p = random_prompts(25, [100], 320)[0]
    eng.add_request("abort-me", p, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.scheduler.kv_cache_manager.usage > 0
    assert eng.abort_request("abort-me")
    assert not eng.has_unfinished_requests()
    eng.step()
    assert eng.scheduler.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize(
    "prompt, kw, message",
    [
        ([5] * 505, dict(max_tokens=10), "exceeds max_model_len"),
        ([], dict(), "at least one token"),
        ([3, 999], dict(), "out of range"),
    ],
)
def test_bad_requests_raise(llm, prompt, kw, message):
    with pytest.raises(ValueError, match=message):
        _gen(llm, [prompt], **kw)
    assert not llm.engine.has_unfinished_requests()


def test_recompile_guard_notices_a_new_shape(llm):
    runner = llm.engine.runner
    before = runner.compiles_after_warmup
    shapes = runner.shapes
    odd = shapes.buckets[0] + 8  # a shape warm-up never saw (the buckets are powers of two)
    host = HostStep(build_metadata([], shapes, odd), build_sampling([], {}, {}, shapes, odd, False), [], [], odd, False)
    from deepinfer_jax.runner.model_runner import CompileCounter

    c0 = CompileCounter.count()
    runner.run(host)
    assert CompileCounter.count() > c0
    assert runner.compiles_after_warmup == before  # _run is below the guard; execute() counts


@pytest.mark.parametrize("seed", [-5, 2**64 + 3])
def test_any_integer_seed_is_accepted(llm, seed):
    p = random_prompts(26, [6], 320)[0]
    a = _gen(llm, [p], temperature=1.0, seed=seed, max_tokens=4, ignore_eos=True)[0].outputs[0].token_ids
    b = _gen(llm, [p], temperature=1.0, seed=seed, max_tokens=4, ignore_eos=True)[0].outputs[0].token_ids
    assert a == b and len(a) == 4


def test_penalties_see_the_latest_token(llm, hf_case):
    """Greedy with penalties equals a step-by-step reference on HF logits: the history the sampler
    penalises includes the token sampled one step earlier (resolved on the device)."""
    import torch

    model, _ = hf_case("v3_grouped_noaux")
    p = random_prompts(27, [7], 320)[0]
    kw = dict(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.7,
              presence_penalty=0.4)
    got = _gen(llm, [p], **kw)[0].outputs[0].token_ids
    out: list[int] = []
    for _ in range(8):
        with torch.no_grad():
            logits = model(torch.tensor([p + out])).logits[0, -1].double().numpy()
        seen = set(p) | set(out)
        for t in seen:
            logits[t] = logits[t] / 1.3 if logits[t] > 0 else logits[t] * 1.3
        for t in set(out):
            logits[t] -= 0.7 * out.count(t) + 0.4
        out.append(int(np.argmax(logits)))
    assert got == out


def test_a_failed_step_aborts_its_requests_and_the_engine_recovers(llm, monkeypatch):
    eng = llm.engine
    p = random_prompts(28, [20], 320)[0]
    eng.add_request("doomed", p, SamplingParams(max_tokens=5, ignore_eos=True))

    def boom(*a, **k):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(eng.runner, "dispatch", boom)
    with pytest.raises(RuntimeError, match="fell over"):
        eng.step()
    monkeypatch.undo()
    assert not eng.has_unfinished_requests()
    assert eng.scheduler.kv_cache_manager.usage == 0.0
    out = _gen(llm, [p], temperature=0.0, max_tokens=5, ignore_eos=True)[0].outputs[0]  # works again
    assert len(out.token_ids) == 5


def test_prompt_logprobs_match_hf(llm, hf_case):
    """prompt_logprobs: each prompt token's logprob given the ones before it (HF's log-softmax), its vocabulary rank
    and the top k; None for the first token; the same prompt batched with others and a generation request."""
    import torch

    model, _ = hf_case("v3_grouped_noaux")
    p, other = random_prompts(25, [21, 7], 320)
    outs = llm.generate([{"prompt_token_ids": p}, {"prompt_token_ids": other}],
                        [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=4, ignore_eos=True),
                         SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)])
    plp = outs[0].prompt_logprobs
    assert outs[1].prompt_logprobs is None and len(plp) == len(p) and plp[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1).numpy()
    for i in range(1, len(p)):
        entry, row = plp[i], ref[i - 1]
        tok = p[i]
        assert entry[tok].logprob == pytest.approx(row[tok], abs=1e-4)
        assert entry[tok].rank == 1 + int((row > row[tok] + 1e-6).sum())
        top4 = np.argsort(-row)[:4].tolist()
        assert set(top4) <= set(entry) and len(entry) <= 5
        assert [entry[t].logprob for t in top4] == pytest.approx(row[top4].tolist(), abs=1e-4)
        assert [entry[t].rank for t in top4 if t != tok] == [r + 1 for r, t in enumerate(top4) if t != tok]
    # Generation is unchanged by asking for prompt logprobs.
    assert outs[0].outputs[0].token_ids == _gen(llm, [p], temperature=0.0, max_tokens=2,
                                                ignore_eos=True)[0].outputs[0].token_ids


def test_best_of_returns_the_highest_cumulative_logprob(llm):
    """best_of=4, n=2: the two sequences out of the four sampled (the same seeds) with the highest cumulative
    logprobs, best first; logprobs computed for the ranking are not returned unless asked for."""
    p = random_prompts(26, [11], 320)[0]
    kw = dict(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    all4 = _gen(llm, [p], n=4, logprobs=0, **kw)[0].outputs
    best = _gen(llm, [p], n=2, best_of=4, **kw)[0].outputs
    ranked = sorted(all4, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.index for c in best] == [0, 1]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in best)
    with_lp = _gen(llm, [p], n=2, best_of=4, logprobs=1, **kw)[0].outputs
    assert [c.cumulative_logprob for c in with_lp] == pytest.approx([c.cumulative_logprob for c in ranked])
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)


def test_step_counters_count_the_steps_and_their_waits(llm):
    """LLMEngine.step_counters (the server's periodic log line): one count a `step` call, its seconds, and the part
    of them spent waiting in the runner's fetch, which is at most the whole."""
    eng = llm.engine
    n0, s0, w0 = eng.step_counters()
    _gen(llm, random_prompts(23, [9, 17], 320), temperature=0.0, max_tokens=6)
    n1, s1, w1 = eng.step_counters()
    assert n1 - n0 >= 6  # a prefill step and five decode steps at least, then the last fetch
    assert 0.0 < w1 - w0 <= s1 - s0
