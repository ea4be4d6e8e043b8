"""The overlapped speculating loop (RunnerConfig.spec_overlap; engine/spec_overlap.py, runner/spec_overlap.py): step
N + 1 planned and queued before step N is fetched, as if N accepted all its drafts, corrected on the device. On the
shipped default model (its trained MTP layer): greedy output token for token that without speculation, with the
MTP's drafts both accepted and rejected, under chunked prefill, prefix-cache hits, preemption, EOS, stop strings,
min_tokens, n > 1, an abort while an optimistic step is in flight, and a sampled request beside them (whose steps
are fetched in turn); no page left taken, no compile after warm-up. Every fetched step's drafts are the dense MTP
chain's (test_spec_mtp.py's check), so a wrong MTP KV under the corrected positions is caught. The device's
correction against a numpy one, and the one-line refusal of another method."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import random_prompts
from test_spec_mtp import _check_drafts
from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.engine.llm_engine import LLMEngine
from deepinfer_jax.models.cache import StepMetadata
from deepinfer_jax.runner import spec_overlap as dev

K = 3
DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "deepinfer_jax",
                       "assets", "default-model")
ARGS = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, page_size=8,
            progress=False, token_buckets=(32,))
SPEC = {"method": "deepseek_mtp", "num_speculative_tokens": K}


def _engine(ref: LLMEngine, spec=SPEC, **runner) -> LLMEngine:
    """An engine over `ref`'s loaded weights with `spec` and RunnerConfig changes `runner`."""
    return LLMEngine(ref.cfg, ref.runner.params, ref.tokenizer, scheduler_config=ref.scheduler_config,
                     cache_config=ref.cache_config, runner_config=dataclasses.replace(ref.runner.runner_cfg, **runner),
                     num_pages=33, progress=False, speculative_config=spec)


@pytest.fixture(scope="module")
def engines():
    # 33 pages of 8 tokens (the fewest max_model_len allows): the prompts cannot all run at once (preemption)
    llm = LLM(DEFAULT, num_pages=33, **ARGS)
    return llm.engine, _engine(llm.engine, spec_overlap=True)


def _run(eng, prompts, params, abort=None):
    """Outputs {id: [(token ids, text, finish reason) a child]}; `abort`: an id aborted at the first step that leaves
    an optimistic step in flight."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = [(c.token_ids, c.text, c.finish_reason) for c in o.outputs]
        if abort is not None and getattr(eng, "_overlap", None) is not None and eng.abort_request(abort):
            abort = None
    assert abort is None
    return out


def _prompts():
    """Random prompts (their drafts are often rejected), one longer than the token budget (chunked prefill), two
    sharing a 44-token prefix (prefix-cache hits)."""
    rng = np.random.default_rng(5)
    shared = rng.integers(2, 2000, 44).tolist()
    return [shared + [9, 9, 9], shared + rng.integers(2, 2000, 6).tolist(), rng.integers(2, 2000, 90).tolist()] + \
        random_prompts(31, [5, 17, 40, 23], 2000)


def test_greedy_output_is_that_without_speculation(engines):
    ref, ov = engines
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    want = _run(ref, prompts, params)
    before = ov.scheduler.num_preemptions, ov.scheduler.kv_cache_manager.prefix_cache_hits, ov.num_overlapped_steps
    assert _run(ov, prompts, params) == want
    s = ov.spec_stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # drafts accepted, and rejected
    assert ov.num_overlapped_steps - before[2] >= 10
    assert ov.scheduler.num_preemptions > before[0] and ov.scheduler.kv_cache_manager.prefix_cache_hits > before[1]
    assert ov.runner.compiles_after_warmup == 0
    assert ov.scheduler.kv_cache_manager.usage == 0.0  # every page back in the pool


def test_stops_n_abort_and_a_sampled_request(engines):
    """Chat prompts to EOS, a stop string, min_tokens, n = 2 and an aborted request, overlapped; then the same with
    a seeded sampled request in every step (fetched in turn): each greedy output that without speculation."""
    ref, ov = engines
    tok = ref.tokenizer
    prompts = [tok.encode(m) for m in ("Hello! How are you today?", "Can you tell me a fun fact?",
                                       "What is 12 + 35?", "Thanks for your help!")] + _prompts()[3:5]
    params = [SamplingParams(temperature=0.0, max_tokens=40), SamplingParams(temperature=0.0, max_tokens=40, stop=["e"]),
              SamplingParams(temperature=0.0, max_tokens=30, n=2), SamplingParams(temperature=0.0, max_tokens=9,
                                                                                   min_tokens=7),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    want = _run(ref, prompts, params)
    before = ov.num_overlapped_steps
    got = _run(ov, prompts, params, abort="5")
    assert ov.num_overlapped_steps > before
    assert "5" not in got and got == {k: v for k, v in want.items() if k != "5"}
    assert any(c[2] == "stop" for v in got.values() for c in v)
    mixed = [*prompts[:4], prompts[4]]
    sampled = [*params[:4], SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)]
    got = _run(ov, mixed, sampled)
    assert {k: v for k, v in got.items() if k != "4"} == {k: v for k, v in want.items() if k in "0123"}
    assert len(got["4"][0][0]) == 20
    assert ov.runner.compiles_after_warmup == 0 and ov.scheduler.kv_cache_manager.usage == 0.0


def test_drafts_are_the_dense_mtp_chain(engines):
    """After each fetched step, each request's new drafts against the dense chain over its real tokens: a prompt
    that fills the prefix cache, one that hits it (chunked prefill) and a chat prompt (drafts accepted)."""
    ref, ov = engines
    record, checked, before = ov.mtp_proposer.record, [], ov.num_overlapped_steps

    def checking(engine, plan, result):
        record(engine, plan, result)
        for seq in plan.seqs:
            req, rec = engine.scheduler.requests.get(seq.request_id), engine.mtp_proposer._drafts.get(seq.request_id)
            if req is not None and rec is not None and rec[0] == req.num_tokens:
                _check_drafts(_Holder(ov), req.all_token_ids, rec[1])
                checked.append(seq.request_id)

    ov.mtp_proposer.record = checking
    try:
        rng = np.random.default_rng(8)
        shared = rng.integers(2, 2000, 44).tolist()
        prompts = [shared + [5, 6], shared + rng.integers(2, 2000, 40).tolist(),
                   ref.tokenizer.encode("Can you tell me a fun fact?")]
        _run(ov, prompts, [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 3)
    finally:
        del ov.mtp_proposer.record
    assert len(checked) >= 20 and len(set(checked)) == 3 and ov.num_overlapped_steps > before


@dataclasses.dataclass
class _Holder:  # what _check_drafts reads: `.engine`
    engine: LLMEngine


def test_device_correction_against_numpy():
    """runner/spec_overlap.resolve: a row whose step planned 2 drafts and accepted 0 moves back 2 positions, one
    that accepted both stays; tokens from the previous step's rows and drafts; padding untouched."""
    M, ps = 4, 4
    prev = np.zeros(dev.prev_size(M, K), np.int32)
    prev[:M] = [50, 51, 52, 53]  # last emitted token a row
    prev[M:2 * M] = [0, 2, 0, 0]  # accepted drafts a row
    prev[2 * M:] = np.arange(100, 100 + M * K)  # drafts
    page_table = np.array([[1, 2, 3, 0], [4, 5, 6, 0], [0] * 4, [0] * 4], np.int32)
    ids = [dev.bonus_placeholder(2, 2, M), dev.draft_placeholder(2, 0, K, M), dev.bonus_placeholder(1, 2, M),
           dev.draft_placeholder(1, 2, K, M), 0, 0]  # rows 0, 1 of this step continue rows 2, 1 of the last
    pos = np.array([6, 7, 9, 10, 0, 0], np.int32)
    seq = np.array([0, 0, 1, 1, 0, 0], np.int32)
    slots = np.array([page_table[s, p // ps] * ps + p % ps for s, p in zip(seq, pos)], np.int32)
    slots[4:] = [0, 1]  # padding: the null page
    meta = StepMetadata(jnp.asarray(ids, jnp.int32), jnp.asarray(pos), jnp.asarray(seq), jnp.asarray(slots),
                        jnp.asarray(page_table), jnp.zeros(4, jnp.int32))
    out, _ = dev.resolve(meta, None, jnp.asarray(prev), M, K, ps)
    assert np.asarray(out.token_ids).tolist() == [52, 100 + 2 * K, 51, 100 + K + 2, 0, 0]
    want_pos = [4, 5, 9, 10, 0, 0]  # row 0: planned 2 drafts, the last step accepted 0 of them
    assert np.asarray(out.positions).tolist() == want_pos
    want_slots = [page_table[s, p // ps] * ps + p % ps for s, p in zip(seq[:4], want_pos[:4])] + [0, 1]
    assert np.asarray(out.slot_mapping).tolist() == want_slots


def test_refused_with_another_method(engines):
    ref, _ = engines
    with pytest.raises(ValueError, match="spec_overlap needs speculative_config method 'deepseek_mtp'"):
        _engine(ref, spec={"method": "ngram", "num_speculative_tokens": K}, spec_overlap=True)


def test_default_runs_it_wherever_it_can():
    """RunnerConfig.spec_overlap None (the default) runs the overlapped loop with `deepseek_mtp` and the plain loop
    where it cannot run, without a word; True is refused there in one line; False never runs it."""
    from deepinfer_jax.config import RunnerConfig, SpeculativeConfig
    from deepinfer_jax.engine.spec_overlap import check

    mtp, ngram = SpeculativeConfig("deepseek_mtp", K), SpeculativeConfig("ngram", K, prompt_lookup_min=1,
                                                                          prompt_lookup_max=3)
    auto, on, off = RunnerConfig(), RunnerConfig(spec_overlap=True), RunnerConfig(spec_overlap=False)
    assert auto.spec_overlap is None
    assert check(mtp, auto, None, None, False) and check(mtp, on, None, None, False)
    assert not check(mtp, off, None, None, False)
    for spec, host_tier in ((ngram, False), (None, False), (mtp, True)):
        assert not check(spec, auto, None, None, host_tier)
        with pytest.raises(ValueError, match="^spec_overlap "):
            check(spec, on, None, None, host_tier)
