"""The overlapped speculating loop (RunnerConfig.spec_overlap, `deepseek_mtp`; docs/speculative.md "Overlap").

`speculative_step` (engine/speculative.py) fetches step N before it plans N + 1: the plan needs each sequence's
accepted drafts and the MTP's new ones. Here N + 1 is planned and queued first, as vLLM's async scheduling does with
speculation: each sequence of N is taken as if all its drafts were accepted (scheduler/spec_overlap.py
`apply_optimistic`), so N + 1 verifies it one position after them; its first token and its K drafts are
placeholders for what N emits and drafts, which the device resolves, moving the sequence's positions and slots back
by the drafts N rejected (runner/spec_overlap.py). Then N is fetched and its real tokens replace the placeholders
(`apply_fetched`), the stops are checked, and N's text and outputs are made while the device runs N + 1.

A step overlaps only where every sampling request's result cannot change what the host decided before it: greedy,
no logprobs, penalties, logit bias or grammar (those steps' sampling tensors would need the real tokens), past
min_tokens, and at least K + 2 tokens from max_tokens and max_model_len (a length stop is never decided on
placeholders). Any other step is fetched before the next is planned, as `speculative_step` does; a step planned
while an optimistic one is in flight is correct either way."""

from __future__ import annotations

from deepinfer_jax.engine.speculative import apply_result, count_drafts
from deepinfer_jax.runner.inputs import needs_full_variant
from deepinfer_jax.runner.spec_overlap import bonus_placeholder, draft_placeholder
from deepinfer_jax.scheduler import spec_overlap as sched_overlap
from deepinfer_jax.types import RequestOutput


def check(spec, runner_config, sharding, kv_pools, host_tier: bool) -> bool:
    """Whether the engine runs the overlapped loop. RunnerConfig.spec_overlap None (the default): wherever it can;
    True: there, and refused in one line where it cannot; False: never."""
    want = runner_config.spec_overlap
    if want is False:
        return False
    why = None
    if spec is None or spec.method != "deepseek_mtp":
        why = "spec_overlap needs speculative_config method 'deepseek_mtp' (its drafts stay on the device)"
    elif sharding is not None and sharding.num_ranks > 1:
        why = "spec_overlap is not supported with data-parallel attention (--data-parallel-size > 1)"
    elif kv_pools is not None:
        why = "spec_overlap is not supported on DeepSeek-V4's per-group cache"
    elif host_tier:
        why = "spec_overlap is not supported with kv_offloading_size (the KV cache's host tier)"
    if why is not None and want:
        raise ValueError(why)
    return why is None


def _overlappable(engine, req, k: int) -> bool:
    """Whether a request's step may be applied before its results are known (the module's docstring)."""
    sp = req.sampling_params
    room = k + 2
    return (req.grammar is None and sp.is_greedy() and not needs_full_variant(req)
            and req.num_output_tokens >= sp.min_tokens and req.num_tokens + room < engine.max_model_len
            and (sp.max_tokens is None or req.num_output_tokens + room < sp.max_tokens))


def propose(engine, pending) -> None:
    """Drafts for every running request that decodes next: a request of the optimistic step in flight gets
    placeholders for the K drafts its MTP makes there; the others the MTP's last drafts (engine/spec_mtp.py)."""
    k, rows = engine.spec.num_speculative_tokens, engine.runner.max_rows
    row_of = {} if pending is None else pending[2]
    for req in engine.scheduler.running:
        if req.grammar is None and req.num_tokens - req.num_computed_tokens == 1:
            r = row_of.get(req.request_id)
            if r is None:  # (never an older step's placeholders)
                req.spec_token_ids = engine.mtp_proposer.latest(req)
            else:
                req.spec_token_ids = [draft_placeholder(r, i, k, rows) for i in range(k)]


def _fetch_optimistic(engine, pending, next_seqs: dict) -> list:
    """Fetch the optimistic step in flight and apply its real tokens -> `_emit`'s entries."""
    plan, inflight, _ = pending
    result = engine.runner.fetch(inflight)
    fetched = []
    for seq in plan.seqs:
        tokens = result.spec_token_ids.get(seq.request_id)
        if not seq.sample or tokens is None:
            continue
        applied = sched_overlap.apply_fetched(engine.scheduler, seq, tokens, next_seqs.get(seq.request_id))
        pid = engine._child_parent.get(seq.request_id)
        if applied is None or pid is None:  # finished or aborted meanwhile
            continue
        count_drafts(engine.spec_stats, seq, tokens)
        fetched.append((applied[0], applied[1], None, pid))  # greedy, no logprobs
    engine.mtp_proposer.record(engine, plan, result)
    return fetched


def overlapped_step(engine) -> list[RequestOutput]:
    """`LLMEngine.step` with RunnerConfig.spec_overlap: propose and plan step N + 1 (placeholders for what the
    optimistic step N in flight emits and drafts), queue it, then fetch N and apply it, make N's text and outputs,
    and apply N + 1 optimistically where it may (else fetch it now). Returns step N's outputs."""
    sched = engine.scheduler
    pending, engine._overlap = engine._overlap, None
    propose(engine, pending)
    plan = sched.schedule()
    fetched, engine._spec_unemitted = engine._spec_unemitted, []
    if plan.is_empty:
        if pending is not None:
            fetched += _fetch_optimistic(engine, pending, {})
        return engine._emit(fetched)
    requests = {s.request_id: sched.requests[s.request_id] for s in plan.seqs}
    try:
        inflight = engine.runner.dispatch(plan.seqs, requests, engine._seeds)
    except Exception:
        if pending is not None:
            fetched += _fetch_optimistic(engine, pending, {})
        engine._spec_unemitted = fetched
        engine._fail_plan(plan)
        raise
    if pending is not None:
        engine.num_overlapped_steps += 1
        fetched += _fetch_optimistic(engine, pending, {s.request_id: s for s in plan.seqs})
    outputs = engine._emit(fetched)  # step N's text (stop strings) before N + 1's placeholders go in
    k, rows = engine.spec.num_speculative_tokens, engine.runner.max_rows
    samplers = [(r, s) for r, s in enumerate(plan.seqs) if s.sample and s.request_id in sched.requests]
    if all(_overlappable(engine, sched.requests[s.request_id], k) for _, s in samplers):
        sched_overlap.apply_optimistic(sched, plan, {s.request_id: [bonus_placeholder(r, s.num_draft_tokens, rows)] *
                                       (s.num_draft_tokens + 1) for r, s in samplers})
        engine._overlap = (plan, inflight, {s.request_id: r for r, s in samplers})
        return outputs
    apply_result(engine, plan, engine.runner.fetch(inflight))
    return outputs
