"""The scheduler's side of the overlapped speculating loop (RunnerConfig.spec_overlap; engine/spec_overlap.py).

A step is applied twice. Once dispatched, before its results exist (`apply_optimistic`): every sampling sequence's
request takes num_draft_tokens + 1 placeholder ids, as if all its drafts were accepted, and counts all its inputs
as computed, so the next step can be planned at once (one position after them). Once fetched (`apply_fetched`):
the placeholders give way to the tokens the step emitted (up to the first stop), the computed tokens fall back to
the inputs those confirm, and the next step's seq of the request, planned too far by the drafts that were
rejected, is moved back as the device moved it (runner/spec_overlap.py). Blocks are hashed for the prefix cache
only at that second point, over real tokens; the pages taken for the optimistic positions stay the request's and
are freed with the others. The caller never applies a step optimistically where a length limit could be reached
before its results are known, so no stop is decided on placeholders."""

from __future__ import annotations

from deepinfer_jax.types import RequestStatus


def apply_optimistic(sched, plan, placeholders: dict[str, list[int]]) -> None:
    """`plan` (the last schedule()'s, just dispatched) as if every draft were accepted: each sampling seq's request
    appends placeholders[its id] (num_draft_tokens + 1 ids). Replaces update_from_output for this plan."""
    if plan is not sched._inflight:
        raise RuntimeError("apply_optimistic() needs the plan of the last schedule()")
    sched._inflight = None
    for seq in plan.seqs:
        request = sched.requests.get(seq.request_id)
        if request is None:
            continue
        request.num_computed_tokens = seq.start_pos + len(seq.token_ids)
        if not seq.sample:  # a prefill chunk: its tokens are the prompt's
            sched.kv_cache_manager.cache_blocks(request)
            continue
        ids = placeholders[seq.request_id]
        if len(ids) != seq.num_draft_tokens + 1:
            raise ValueError(f"request {seq.request_id}: {len(ids)} placeholders for {seq.num_draft_tokens} drafts")
        request.output_token_ids.extend(ids)
        request.spec_token_ids = []


def apply_fetched(sched, seq, tokens: list[int], next_seq=None):
    """A sampling `seq` of an optimistically applied step, with the tokens it emitted (its accepted drafts and the
    target's token): its placeholders replaced by them up to the first stop. `next_seq`: the request's seq in the
    step planned since (or None), whose positions move back by the drafts rejected. -> (the request, tokens appended, finished),
    or None where the request is gone (finished or aborted meanwhile)."""
    request = sched.requests.get(seq.request_id)
    if request is None:
        return None
    out = request.output_token_ids
    del out[len(out) - seq.num_draft_tokens - 1:]
    preempted = request.status == RequestStatus.PREEMPTED  # by the plan made since: it computes all again
    finished, appended = sched._apply_verified(request, seq, tokens)
    if preempted:
        request.num_computed_tokens = 0
    if next_seq is not None:
        next_seq.start_pos -= seq.num_draft_tokens - (len(tokens) - 1)
    if finished:
        if request in sched.running:
            sched.running.remove(request)
        elif request in sched.waiting:
            sched.waiting.remove(request)
        sched._release(request)
    return request, appended, finished
