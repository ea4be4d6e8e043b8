"""What a request returns: its RequestOutput after a step, shaped by its RequestOutputKind, and the logprob entries
of its sampled and prompt tokens (vLLM's order: the token's own entry first, then the top k with their ranks)."""

from __future__ import annotations

from deepinfer_jax.engine.request_state import Parent
from deepinfer_jax.types import CompletionOutput, Logprob, RequestOutput, RequestOutputKind


def sampled_logprobs(token: int, lp, k: int) -> dict[int, Logprob]:
    """The entry of one sampled token: `lp` is (its logprob, the top ids, their logprobs) from the runner; its rank
    counts the alternatives above it."""
    sampled_lp, top_ids, top_lps = lp
    entry = {token: Logprob(sampled_lp, rank=1 + sum(1 for v in top_lps if v > sampled_lp))}
    for rank, (tid, tlp) in enumerate(zip(top_ids[:k], top_lps[:k]), start=1):
        entry.setdefault(tid, Logprob(tlp, rank=rank))
    return entry


def prompt_logprobs(prompt_token_ids: list[int], scored, k: int) -> list[dict[int, Logprob] | None]:
    """Each prompt token's logprob given the ones before it (rank included), then the top k; None for the first
    token. `scored`: the runner's score_prompt (logprobs, ranks, top ids, top logprobs), a row a token after the
    first."""
    lps, ranks, top_ids, top_lps = scored
    out: list[dict[int, Logprob] | None] = [None]
    for tok, lp, rank, ids, vals in zip(prompt_token_ids[1:], lps.tolist(), ranks.tolist(),
                                        top_ids[:, :k].tolist(), top_lps[:, :k].tolist()):
        entry = {tok: Logprob(lp, rank=rank)}
        for r, (tid, v) in enumerate(zip(ids, vals), start=1):
            entry.setdefault(tid, Logprob(v, rank=r))
        out.append(entry)
    return out


def request_output(parent: Parent) -> RequestOutput | None:
    """The parent's output after a step, shaped by its RequestOutputKind; None when that kind has nothing to return
    (FINAL_ONLY, or best_of, before the end). A DELTA output lists only the children with new tokens, text or a
    finish, each with only what is new (it advances their `sent_*` counters); its host work is O(new)."""
    finished = all(c.request.is_finished for c in parent.children)
    kind = parent.children[0].request.sampling_params.output_kind
    best_of = len(parent.children) > parent.n
    if (kind == RequestOutputKind.FINAL_ONLY or best_of) and not finished:
        return None
    delta = kind == RequestOutputKind.DELTA
    children = parent.children
    if best_of:  # the n best by cumulative logprob, in that order (ties: the earlier sequence)
        children = sorted(children, key=lambda c: -c.cumulative_logprob)[: parent.n]
    outs = []
    for index, c in enumerate(children):
        r = c.request
        if delta:
            done = r.is_finished and not c.reported_finished
            if len(r.output_token_ids) == c.sent_tokens and not c.text_parts and not done:
                continue
            token_ids = r.output_token_ids[c.sent_tokens:]
            logprobs = None if c.logprobs is None else c.logprobs[c.sent_logprobs:]
            c.sent_tokens += len(token_ids)
            c.sent_logprobs += 0 if logprobs is None else len(logprobs)
            c.reported_finished = r.is_finished
        else:
            token_ids = list(r.output_token_ids)
            logprobs = None if c.logprobs is None else list(c.logprobs)
        outs.append(CompletionOutput(
            index=index if best_of else c.index, text=c.take_text(delta), token_ids=token_ids,
            logprobs=None if parent.hide_logprobs else logprobs, finish_reason=r.finish_reason,
            stop_reason=r.stop_reason, cumulative_logprob=None if parent.hide_logprobs else c.cumulative_logprob))
    out = RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                        parent.children[0].request.num_cached_tokens, outs, finished,
                        prompt_logprobs=parent.prompt_logprobs)
    if delta:
        parent.prompt_logprobs = None  # returned once
    return out
