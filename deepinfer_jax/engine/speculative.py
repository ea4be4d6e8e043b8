"""Speculative decoding's engine side (LLMEngine's docstring tells the whole): the drafts proposed before each
plan, the step that verifies them (planned, run and fetched in turn) and the counters of vLLM's spec_decode
metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_jax.engine.spec_draft import drafter_for  # noqa: F401 - the draft_model method's (LLMEngine's)
from deepinfer_jax.engine.spec_mtp import MTPProposer
from deepinfer_jax.scheduler.ngram import propose_ngram
from deepinfer_jax.types import RequestOutput


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counters (vLLM's spec_decode_* metrics): sequences that verified drafts in a step
    (`num_drafts`), the drafts verified, those accepted, and accepted ones by position (index i: drafts accepted
    at position i + 1). Mean acceptance length = 1 + num_accepted_tokens / num_drafts."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def spec_shapes(spec) -> dict:
    """runner.inputs.Shapes' speculation fields for `spec` (a SpeculativeConfig or None)."""
    k = 0 if spec is None else spec.num_speculative_tokens
    return dict(spec_width=1 + k, mtp_drafts=k if spec is not None and spec.method == "deepseek_mtp" else 0)


def spec_state(spec) -> tuple[SpecDecodeStats | None, MTPProposer | None]:
    """The engine's speculation state for `spec` (a SpeculativeConfig or None): its counters, and with
    `deepseek_mtp` the MTPProposer that keeps the MTP's drafts (engine/spec_mtp.py)."""
    if spec is None:
        return None, None
    return SpecDecodeStats(spec.num_speculative_tokens), MTPProposer() if spec.method == "deepseek_mtp" else None


def propose(engine) -> None:
    """Drafts for every running request that decodes next (one token to compute) and has no grammar: the MTP's
    from the last step (engine/spec_mtp.py), the draft model's (engine/spec_draft.py), or n-gram prompt lookup."""
    spec = engine.spec
    if spec.method == "deepseek_mtp":
        return engine.mtp_proposer.propose(engine)
    if spec.method == "draft_model":  # engine/spec_draft.py
        return engine.drafter.propose(engine)
    k, lo, hi = spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
    for req in engine.scheduler.running:
        if req.grammar is None and req.num_tokens - req.num_computed_tokens == 1:
            req.spec_token_ids = propose_ngram(req.all_token_ids, k, lo, hi)


def speculative_step(engine) -> list[RequestOutput]:
    """One step with speculation: propose, plan, run and fetch step N and apply it (the scheduler appends each
    sequence's tokens up to its first stop). The next plan needs how many drafts step N accepted, so the host waits
    for it; what does not feed the next plan (step N-1's text, stop strings and outputs: `_emit`) runs after step
    N is queued, while the device computes it. Returns step N-1's outputs (as the plain step does); a step with
    nothing to plan returns the last fetched step's.

    A stop string found by that text pass finishes its request after step N was planned with it: step N's tokens
    for it are then dropped (the scheduler skips finished requests), as the plain step's are."""
    propose(engine)
    plan = engine.scheduler.schedule()
    engine.runner.apply_kv_transfers(getattr(plan, "kv_transfers", None))  # host tier: before the step
    fetched, engine._spec_unemitted = engine._spec_unemitted, []
    if plan.is_empty:
        return engine._emit(fetched)
    requests = {s.request_id: engine.scheduler.requests[s.request_id] for s in plan.seqs}
    try:
        inflight = engine.runner.dispatch(plan.seqs, requests, engine._seeds, getattr(plan, "ranks", None))
    except Exception:
        engine._spec_unemitted = fetched
        engine._fail_plan(plan)
        raise
    outputs = engine._emit(fetched)  # step N-1's text and outputs while the device runs step N
    apply_result(engine, plan, engine.runner.fetch(inflight))
    return outputs


def count_drafts(stats: SpecDecodeStats, seq, tokens: list[int]) -> None:
    """`seq`'s drafts and how many of them its emitted `tokens` (the accepted drafts and one more) accepted."""
    if seq.num_draft_tokens:
        stats.num_drafts += 1
        stats.num_draft_tokens += seq.num_draft_tokens
        stats.num_accepted_tokens += len(tokens) - 1
        for i in range(len(tokens) - 1):
            stats.num_accepted_tokens_per_pos[i] += 1


def apply_result(engine, plan, result) -> None:
    """A fetched speculating step's `result` applied in turn: the draft counts, the scheduler's roll back
    (update_from_output), the MTP's drafts for the next step, the grammars advanced, and the emitted tokens queued in
    `engine._spec_unemitted` for the text pass after the next step is queued."""
    live = engine.scheduler.requests
    for seq in plan.seqs:
        tokens = result.spec_token_ids.get(seq.request_id)
        if tokens is not None and seq.request_id in live:  # (not finished meanwhile)
            count_drafts(engine.spec_stats, seq, tokens)
    updates = engine.scheduler.update_from_output(plan, result.spec_token_ids)
    if engine.spec.method == "deepseek_mtp":
        engine.mtp_proposer.record(engine, plan, result)
    for req, tokens, _ in updates:
        pid = engine._child_parent.get(req.request_id)
        if pid is None:
            continue
        if req.grammar is not None and not req.is_finished:  # no drafts: one token (its mask needs it next step)
            engine._advance_grammar(req, tokens[0])
        lps = result.spec_logprobs.get(req.request_id)
        engine._spec_unemitted.append((req, tokens, None if lps is None else lps[: len(tokens)], pid))
