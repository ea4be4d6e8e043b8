"""Scheduler and KV manager under speculative decoding: drafts verified within the budget and the length limits,
their slots allocated ahead, rejected ones rolled back (computed tokens, prefix cache), memory pressure cutting
speculation before anyone is preempted, stops inside the accepted tokens; and the n-gram proposer."""

from deepinfer_jax.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from deepinfer_jax.scheduler.ngram import propose_ngram
from deepinfer_jax.scheduler.scheduler import Scheduler
from deepinfer_jax.types import Request, SamplingParams

import pytest

PS = 4
EOS = 2


def make(num_pages=64, budget=16, max_len=64):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_len),
                     CacheConfig(page_size=PS), num_pages)


def decoding(s, rid="a", n=6, max_tokens=20, **sp):
    """A request past its prefill (one output token), ready to decode."""
    r = Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens, **sp), eos_token_ids=(EOS,))
    s.add_request(r)
    plan = s.schedule()
    s.update_from_output(plan, {rid: 50})
    return r


def test_drafts_verified_accepted_prefix_applied_and_rest_rolled_back():
    s = make()
    r = decoding(s)
    kv = s.kv_cache_manager
    r.spec_token_ids = [51, 52, 53]
    plan = s.schedule()
    (seq,) = plan.seqs
    assert (seq.token_ids, seq.start_pos, seq.num_draft_tokens, seq.is_decode) == ([50, 51, 52, 53], 6, 3, True)
    assert len(kv.get_block_ids("a")) == 3  # slots for positions 6..9
    # two drafts accepted, then the target's own token 60
    (_, appended, finished), = s.update_from_output(plan, {"a": [51, 52, 60]})
    assert appended == [51, 52, 60] and not finished and r.spec_token_ids == []
    assert r.output_token_ids == [50, 51, 52, 60] and r.num_computed_tokens == 9 == r.num_tokens - 1
    # the page of the rejected draft's slot stays the request's; the next step writes there again
    plan = s.schedule()
    assert plan.seqs[0].start_pos == 9 and plan.seqs[0].token_ids == [60]
    assert len(kv.get_block_ids("a")) == 3
    s.update_from_output(plan, {"a": 61})
    s.finish_request("a", "abort")
    assert kv.usage == 0.0


def test_rejected_drafts_are_never_prefix_cached():
    s = make()
    r = decoding(s, n=6)  # tokens 100..105, 50: computed 6
    r.spec_token_ids = [51, 52, 53]
    plan = s.schedule()
    s.update_from_output(plan, {"a": [70]})  # the first draft rejected: computed 7, page 1 not full
    assert r.num_computed_tokens == 7
    kv = s.kv_cache_manager
    assert kv._num_cached["a"] == 1  # only the page of positions 0..3
    # a new request with the same prompt and the drafts as continuation hits only the first page
    twin = Request("b", list(range(100, 106)) + [50, 51, 52, 53, 1], SamplingParams(max_tokens=2))
    assert kv.get_computed_blocks(twin)[1] == PS


def test_drafts_capped_by_budget_max_tokens_and_max_model_len():
    s = make(budget=3)
    r = decoding(s, n=2, max_tokens=20)
    r.spec_token_ids = [1, 3, 4, 5]
    assert s.schedule().seqs[0].num_draft_tokens == 2  # 1 + 2 tokens fill the budget of 3
    s2 = make()
    r2 = decoding(s2, max_tokens=3)  # one output out, at most 2 more: 1 draft + the bonus
    r2.spec_token_ids = [3, 4, 5]
    assert s2.schedule().seqs[0].num_draft_tokens == 1
    s3 = make(max_len=10)
    r3 = decoding(s3, n=6, max_tokens=4)  # 7 tokens known: positions up to 9, one more token after the drafts
    r3.spec_token_ids = [3, 4, 5]
    assert s3.schedule().seqs[0].num_draft_tokens == 2


def test_stop_inside_the_accepted_tokens_drops_the_rest():
    s = make()
    r = decoding(s)
    r.spec_token_ids = [EOS, 52, 53]
    plan = s.schedule()
    (_, appended, finished), = s.update_from_output(plan, {"a": [EOS, 52, 53, 54]})
    assert appended == [EOS] and finished and r.finish_reason == "stop"
    assert s.kv_cache_manager.usage == 0.0


def test_memory_pressure_cuts_speculation_before_preempting():
    # 4 usable pages: a (6 prompt + 1 output: 2 pages) and b (2 pages) fill the pool
    s = make(num_pages=5, max_len=16)
    a, b = (Request(rid, list(range(100, 106)), SamplingParams(max_tokens=8)) for rid in "ab")
    s.add_request(a)
    s.add_request(b)
    s.update_from_output(s.schedule(), {"a": 50, "b": 50})
    a.spec_token_ids = [1, 3, 4]  # would need a third page
    plan = s.schedule()
    assert [q.num_draft_tokens for q in plan.seqs] == [0, 0] and not plan.preempted_ids
    s.update_from_output(plan, {"a": 60, "b": 61})
    assert b.num_computed_tokens == 7


def test_ngram_proposals():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3, 1, 3) == [4, 1, 2]  # the 3-gram (1, 2, 3) seen before
    assert propose_ngram([1, 2, 9, 1, 2], 4, 2, 2) == [9, 1, 2]
    assert propose_ngram([1, 2, 3], 2, 1, 2) == []  # nothing repeats
    assert propose_ngram([5, 6, 5, 7, 5], 2, 1, 1) == [7, 5]  # the latest earlier match
    assert propose_ngram([4, 8, 1, 2, 3, 4, 8], 2, 3, 3) == []  # only a 2-gram repeats, min_n is 3


@pytest.mark.parametrize("cfg, message", [
    (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens must be an integer >= 1"),
    (dict(method="medusa", num_speculative_tokens=2), "method 'medusa' is not one of"),
    (dict(method="ngram", num_speculative_tokens=2, lookahead=3), r"unknown keys \['lookahead'\]"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2), "exceeds"),
    (dict(method="draft_model", num_speculative_tokens=2), "needs 'model'"),
    (dict(method="ngram"), "needs 'num_speculative_tokens'"),
    ('{"method": "ngram",', "not valid JSON"),
])
def test_bad_speculative_configs_are_one_line_errors(cfg, message):
    with pytest.raises(ValueError, match=message) as e:
        SpeculativeConfig.parse(cfg)
    assert "\n" not in str(e.value)


def test_speculative_config_defaults_and_unsupported_methods():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_max": 4}).prompt_lookup_min == 4
    SpeculativeConfig.parse({"method": "deepseek_mtp", "num_speculative_tokens": 1}).check_supported()
    with pytest.raises(ValueError, match="model '/nowhere/draft' \\(the draft\\) is not a directory"):
        SpeculativeConfig.parse({"method": "draft_model", "model": "/nowhere/draft",
                                 "num_speculative_tokens": 2}).check_supported()
