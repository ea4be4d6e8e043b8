"""Continuous-batching scheduler (vLLM v1 style): one StepPlan per engine step.

One vocabulary for prefill and decode: each request has `num_tokens` (prompt + outputs) and
`num_computed_tokens` (KV in the cache); a step schedules some of the difference. When a request's
computed tokens reach `num_tokens` after the step, the step samples its next token (`sample=True`).

Per step, under `max_num_batched_tokens` (token budget) and `max_num_seqs`:
1. running requests with one token left (decodes), oldest first;
2. running requests mid-prefill (chunked prefill continues), oldest first;
3. waiting requests, FCFS, with a prefix-cache lookup on admission; stopped at the first one that
   does not fit, and skipped entirely in a step that preempted.
A prompt longer than the remaining budget takes what is left and continues next step (capped per
step by `long_prefill_token_threshold` when > 0). Decodes are scheduled before any prefill chunk, so
a long prompt never stalls them (keep max_num_batched_tokens >= max_num_seqs, or the newest decodes
wait a step).

Preemption: when a running request cannot get pages, the newest running request not already in
this step's plan is preempted (pages freed, status PREEMPTED, num_computed_tokens = 0, put at the
front of the waiting queue) and allocation is retried; if the newest is the request itself, it is
the one preempted. On re-admission it recomputes prompt + outputs so far (prefix hits allowed).

Protocol: `schedule()` and `update_from_output()` strictly alternate (an empty plan needs no update).
`num_computed_tokens` advances in `update_from_output`, after the step ran; full blocks are
prefix-cached there too, so a hit only ever names pages whose KV was written by an earlier step
(identical prompts admitted in the same step each compute the whole prompt).
Requests finished or aborted in between are skipped by the update.

Speculative decoding: a decode whose request holds drafts (`Request.spec_token_ids`) is scheduled as its last token
and as many drafts as the budget, max_model_len and max_tokens allow, their slots allocated ahead
(`allocate_slots(num_lookahead_tokens=)`) only where they fit without preempting; `update_from_output` takes the
seq's tokens (accepted drafts and the target's own), appends them up to the first stop and counts only the inputs
they confirm as computed, so a rejected draft's slot is written again next step (docs/speculative.md).

Per-group cache (`cache_pools`, config_v4.CachePools: DeepSeek-V4): the pages are accounted per cache group by
scheduler/hybrid_cache_manager.py (windowed groups give pages behind their window back, compressed groups take a
page per page_size x rate tokens, prefix hits end on every compressed group's page boundary); each ScheduledSeq
then carries every group's page table (`group_page_ids`).

Groups (`num_groups` > 1: pipeline parallelism's decode overlap, engine/llm_engine.py): the running requests form
disjoint groups, and `schedule(group)` plans only that group's: its running requests, and waiting ones that are new
or were preempted from it (a request joins the group that admits it and stays in it). A group admits while it runs
fewer than max_num_seqs and fewer than its share, ceil((running + waiting) / num_groups), so the groups stay about
even. Preemption picks the newest unscheduled running request of any group (the oldest keeps its guarantee); a
request preempted from group h waits for h, whose next steps resolve its placeholders (runner: a group's own ids).

Guarantee: `Scheduler.__init__` checks the pool holds cdiv(max_model_len, page_size) pages, and a
request never computes more than max_model_len tokens, so the oldest running request (or, if none,
the waiting head) can always be scheduled: every step with unfinished requests makes progress.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from deepinfer_jax.config import CacheConfig, SchedulerConfig
from deepinfer_jax.scheduler.hybrid_cache_manager import HybridKVCacheManager
from deepinfer_jax.scheduler.kv_cache_manager import KVCacheManager, cdiv
from deepinfer_jax.types import Request, RequestStatus, SamplingParams

_REASONS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


@dataclass
class ScheduledSeq:
    """One sequence's work in a step.

    token_ids: the tokens to compute, at positions start_pos .. start_pos + len(token_ids) - 1.
    page_ids: the sequence's full page table (covers every computed and scheduled position; the
    runner pads it with the null page 0). sample: a token is sampled from the last position.
    num_output_tokens: outputs generated before this step (seeded sampling, penalties).
    page_gen: the page list's lifetime (KVCacheManager.block_list_generation; 0: unknown): a later step's
    seq of the same request and page_gen has these page_ids as its prefix.
    num_draft_tokens: speculative decoding: the last this many of token_ids are drafts (Request.spec_token_ids)
    the step verifies; it samples at its last num_draft_tokens + 1 positions.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    page_ids: list[int]
    sample: bool
    num_output_tokens: int
    sampling_params: SamplingParams | None = None
    page_gen: int = 0
    num_draft_tokens: int = 0
    group_page_ids: tuple[list[int], ...] = ()  # a per-group cache: each group's page table (page_ids: the first's)

    @property
    def is_decode(self) -> bool:
        """One query token, or one and its drafts (the decode path); longer chunks are prefill."""
        return len(self.token_ids) - self.num_draft_tokens == 1


@dataclass
class StepPlan:
    """What the runner computes this step: decodes first, then prefill chunks.

    preempted_ids: requests preempted while planning this step (their pages are free now).
    finished_ids: requests that finished (any reason, aborts included) since the previous plan; the
    runner may drop per-request state for them.
    kv_transfers: the host tier's page copies (scheduler/host_tier.py KVTransfers) to apply before the step's
    program, or None without a tier.
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    kv_transfers: Any = None

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.seqs if s.is_decode)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # the engine's speculative decoding counters (engine/speculative.py SpecDecodeStats, a snapshot), None without
    spec_decode: Any = None
    # The host tier's (scheduler/host_tier.py; all 0 without one): usage, tokens looked up / served, pages copied.
    host_tier_usage: float = 0.0
    host_tier_queries: int = 0
    host_tier_hits: int = 0
    host_blocks_saved: int = 0
    host_blocks_loaded: int = 0


class Scheduler:
    """Owns the waiting queue, the running list and the KV cache manager. Not thread-safe."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_pages: int | None = None,
        num_host_blocks: int = 0,
        cache_pools: Any = None,
    ) -> None:
        num_pages = cache_config.num_pages if num_pages is None else num_pages
        self.config = scheduler_config
        self.page_size = cache_config.page_size
        if cache_pools is not None:  # a per-group cache (config_v4.CachePools): a page table per group
            if num_host_blocks:
                raise ValueError("kv_offloading_size is not supported with a per-group cache (deepseek_v4)")
            self.kv_cache_manager = HybridKVCacheManager(
                cache_pools, cache_config.enable_prefix_caching, scheduler_config.max_model_len,
                scheduler_config.max_num_batched_tokens)
        else:
            if num_pages is None:
                raise ValueError("num_pages must be given (cache_config.num_pages is None)")
            need = cdiv(scheduler_config.max_model_len, self.page_size)
            if need > num_pages - 1:
                raise ValueError(
                    f"num_pages must be at least {need + 1} (max_model_len "
                    f"{scheduler_config.max_model_len} / page_size {self.page_size} + the null page), "
                    f"got {num_pages}"
                )
            self.kv_cache_manager = KVCacheManager(
                num_pages, self.page_size, cache_config.enable_prefix_caching, num_host_blocks
            )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        self._inflight: StepPlan | None = None
        self.num_groups = 1  # the engine sets more (module docstring: Groups)
        self.group_of: dict[str, int] = {}  # request id -> its group, from its admission until it leaves

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already scheduled")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} must be new (WAITING, nothing computed)")
        if not request.prompt_token_ids:
            raise ValueError(f"prompt_token_ids of request {rid!r} must not be empty")
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt_token_ids of request {rid!r} has {request.num_tokens} tokens, more than "
                f"max_model_len {self.config.max_model_len}"
            )
        self.requests[rid] = request
        self.waiting.append(request)

    def finish_request(
        self, request_id: str, reason: str, stop_reason: int | str | None = None
    ) -> bool:
        """Finish a request from outside ("stop" on a stop string, "length", "abort").

        Frees its pages at once; False if the id is unknown or already finished.
        """
        if reason not in _REASONS:
            raise ValueError(f"reason must be one of {sorted(_REASONS)}, got {reason!r}")
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = _REASONS[reason]
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self._release(request)
        return True

    def abort_request(self, request_id: str) -> bool:
        return self.finish_request(request_id, "abort")

    def _release(self, request: Request) -> None:
        """A finished request leaves: pages freed, forgotten, reported in the next plan."""
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.group_of.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)

    # ---- counts --------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        tier = kv.host_tier
        host = {} if tier is None else dict(
            host_tier_usage=tier.usage, host_tier_queries=tier.queries, host_tier_hits=tier.hits,
            host_blocks_saved=tier.blocks_saved, host_blocks_loaded=tier.blocks_loaded)
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            **host,
        )

    # ---- planning ------------------------------------------------------------------------------
    def _chunk(self, remaining: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < remaining:
            remaining = threshold
        return min(remaining, budget)

    def _num_drafts(self, request: Request, budget: int) -> int:
        """How many of a decoding request's drafts a step verifies: within the token budget, max_model_len and
        max_tokens (all accepted, the step emits one token more than it verifies)."""
        sp = request.sampling_params
        k = min(len(request.spec_token_ids), budget, self.config.max_model_len - request.num_tokens - 1)
        if sp.max_tokens is not None:
            k = min(k, sp.max_tokens - request.num_output_tokens - 1)
        return max(k, 0)

    def _seq(self, request: Request, start: int, n: int, num_drafts: int = 0) -> ScheduledSeq:
        kv = self.kv_cache_manager
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.token_ids_slice(start, start + n) + request.spec_token_ids[:num_drafts],
            start_pos=start,
            page_ids=list(self.kv_cache_manager.get_block_ids(request.request_id)),
            sample=start + n == request.num_tokens,
            num_output_tokens=request.num_output_tokens,
            sampling_params=request.sampling_params,
            page_gen=self.kv_cache_manager.block_list_generation(request.request_id),
            num_draft_tokens=num_drafts,
            group_page_ids=(tuple(map(list, kv.group_block_ids(request.request_id)))
                            if isinstance(kv, HybridKVCacheManager) else ()),
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _allocate_or_preempt(
        self, request: Request, n: int, scheduled: set[str], preempted: list[str]
    ) -> bool:
        """Allocate for a running request, preempting the newest unscheduled ones as needed."""
        while not self.kv_cache_manager.allocate_slots(request, n):
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _admissible(self, group: int) -> tuple[list[Request], int]:
        """The waiting requests `group` may admit (FCFS) and how many running requests it may hold."""
        if self.num_groups == 1:
            return list(self.waiting), self.config.max_num_seqs
        if not 0 <= group < self.num_groups:
            raise ValueError(f"group must be in [0, {self.num_groups}), got {group}")
        share = -(-(len(self.running) + len(self.waiting)) // self.num_groups)
        return ([r for r in self.waiting if self.group_of.get(r.request_id, group) == group],
                min(self.config.max_num_seqs, share))

    def schedule(self, group: int = 0) -> StepPlan:
        """The next step of `group`'s requests (module docstring: Groups; with one group, of every request)."""
        if self._inflight is not None:
            raise RuntimeError("schedule() called again before update_from_output() of its plan")
        admissible, cap = self._admissible(group)
        mine = (lambda r: True) if self.num_groups == 1 else (lambda r: self.group_of[r.request_id] == group)
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        scheduled: set[str] = set()
        preempted: list[str] = []

        for want_decode in (True, False):
            for request in list(self.running):
                if budget == 0:
                    break
                if request.status != RequestStatus.RUNNING or request.request_id in scheduled or not mine(request):
                    continue  # preempted earlier in this loop, already planned, or another group's
                remaining = request.num_tokens - request.num_computed_tokens
                if (remaining == 1) != want_decode:
                    continue
                n = self._chunk(remaining, budget)
                # Speculation: the drafts' slots too where they fit without preempting anyone; else plain.
                k = self._num_drafts(request, budget - n) if want_decode else 0
                if k and not self.kv_cache_manager.allocate_slots(request, n, num_lookahead_tokens=k):
                    k = 0
                if k or self._allocate_or_preempt(request, n, scheduled, preempted):
                    seq = self._seq(request, request.num_computed_tokens, n, k)
                    (decodes if seq.is_decode else prefills).append(seq)
                    scheduled.add(request.request_id)
                    budget -= n + k

        held = sum(1 for r in self.running if mine(r))
        for request in admissible:
            if preempted or budget == 0 or held >= cap:
                break
            hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            n = self._chunk(request.num_tokens - num_hit, budget)
            if not self.kv_cache_manager.allocate_slots(request, n, hit_blocks):
                break
            if request is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(request)
            held += 1
            self.group_of[request.request_id] = group
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            seq = self._seq(request, num_hit, n)
            (decodes if seq.is_decode else prefills).append(seq)
            scheduled.add(request.request_id)
            budget -= n

        plan = StepPlan(
            seqs=decodes + prefills,
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted_ids=preempted,
            finished_ids=self._finished_ids,
            kv_transfers=self.kv_cache_manager.take_transfers(),
        )
        self._finished_ids = []
        if plan.seqs:
            self._inflight = plan
        return plan

    # ---- results -------------------------------------------------------------------------------
    def update_from_output(
        self, plan: StepPlan, sampled: dict[str, int]
    ) -> list[tuple[Request, list[int], bool]]:
        """Apply a finished step: advance computed tokens, cache full blocks, append sampled tokens,
        check stop conditions, free finished requests.

        Returns (request, newly appended token ids, finished?) for every request that sampled.
        `sampled` must hold a token for every live `sample=True` sequence (a speculative one, with
        num_draft_tokens: its list of tokens); extra keys are ignored.
        """
        if not plan.seqs:
            return []
        if plan is not self._inflight:
            raise RuntimeError("update_from_output() needs the plan of the last schedule()")
        live = [s for s in plan.seqs if s.request_id in self.requests]
        missing = [s.request_id for s in live if s.sample and s.request_id not in sampled]
        if missing:
            raise KeyError(f"no sampled token for requests {missing}")
        self._inflight = None
        results: list[tuple[Request, list[int], bool]] = []
        any_finished = False
        for seq in live:
            request = self.requests[seq.request_id]
            if seq.num_draft_tokens:
                finished, appended = self._apply_verified(request, seq, sampled[seq.request_id])
            else:
                request.num_computed_tokens = seq.start_pos + len(seq.token_ids)
                self.kv_cache_manager.cache_blocks(request)
                if not seq.sample:
                    continue
                value = sampled[seq.request_id]
                appended = [int(value[0] if isinstance(value, (list, tuple)) else value)]
                request.output_token_ids.append(appended[0])
                finished = self._check_stop(request)
            request.spec_token_ids = []
            if finished:
                any_finished = True
                self._release(request)
            results.append((request, appended, request.is_finished))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return results

    def _apply_verified(self, request: Request, seq: ScheduledSeq, tokens) -> tuple[bool, list[int]]:
        """A speculative seq's result: its tokens (accepted drafts, then the target's own; a list, never
        placeholders) appended up to the first stop; the KV of the inputs they confirm counts as computed (the
        rejected drafts' slots stay in the request's pages, to be written again). -> (finished, appended)."""
        tokens = list(tokens)[: seq.num_draft_tokens + 1] if isinstance(tokens, (list, tuple)) else [tokens]
        appended: list[int] = []
        finished = False
        for token in tokens:
            request.output_token_ids.append(int(token))
            appended.append(int(token))
            if self._check_stop(request):
                finished = True
                break
        # inputs: the last token and the drafts; the first len(appended) of them are confirmed
        request.num_computed_tokens = seq.start_pos + len(seq.token_ids) - seq.num_draft_tokens + len(appended) - 1
        self.kv_cache_manager.cache_blocks(request)
        return finished, appended

    def _check_stop(self, request: Request) -> bool:
        """vLLM's order: length (max_tokens, max_model_len) first, then, once min_tokens outputs
        exist, EOS (unless ignore_eos; stop_reason None) and stop_token_ids (stop_reason = id)."""
        sp = request.sampling_params
        if request.num_tokens >= self.config.max_model_len or (
            sp.max_tokens is not None and request.num_output_tokens >= sp.max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        if request.num_output_tokens < sp.min_tokens:
            return False
        token = request.output_token_ids[-1]
        if not sp.ignore_eos and token in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if token in sp.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
            return True
        return False
