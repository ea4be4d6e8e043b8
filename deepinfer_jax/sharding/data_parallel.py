"""Data-parallel attention on the host: one Scheduler per rank, merged into one device step.

Each DP rank owns its requests, its own page pool (local page ids 1 .. num_pages - 1, page 0 its own
null page) and its own prefix cache; on the device, rank r's pages are the r-th contiguous block of
the global cache's page axis (sharded over "data"), so global page = r * num_pages + local page. The
schedulers never hear of devices: a new request goes to the rank with the fewest unfinished requests
(ties: lowest rank), and from then on only that rank schedules it.

A merged step pads every rank's share to the same token bucket B (the smallest that holds the largest
share) and lays the shares out rank after rank: tokens [dp * B], sequence rows [dp * seq_rows(B)].
Inside a rank's block, the metadata stay rank-local (seq_ids, page ids), which is what the shard_map'd
attention sees; only `logits_indices` are global (they index the whole step's hidden states).

No JAX here (numpy host arrays only), and no import of scheduler/: the engine builds the per-rank
Schedulers and hands them in.
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap

import numpy as np



@dataclasses.dataclass
class DPStepPlan:
    """A StepPlan over all ranks (same fields as scheduler.StepPlan): `ranks[i]` is the rank of
    `seqs[i]`; `rank_plans` the ranks' own plans, which their schedulers get back after the step."""

    seqs: list = dataclasses.field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_ids: list[str] = dataclasses.field(default_factory=list)
    finished_ids: list[str] = dataclasses.field(default_factory=list)
    ranks: list[int] = dataclasses.field(default_factory=list)
    rank_plans: list = dataclasses.field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return sum(p.num_decodes for p in self.rank_plans)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class DPScheduler:
    """The Scheduler interface the engine uses, over one independent Scheduler per rank
    (`schedulers`, each with its own page pool of the same size).

    `max_num_seqs` and `max_num_batched_tokens` hold per rank (as in vLLM and sglang-jax, a step of
    the whole engine carries up to num_ranks times as much)."""

    def __init__(self, schedulers: list) -> None:
        self.ranks = list(schedulers)
        self.config = self.ranks[0].config
        self.requests = ChainMap(*[s.requests for s in self.ranks])
        self._rank_of: dict[str, int] = {}

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def rank_of(self, request_id: str) -> int | None:
        return self._rank_of.get(request_id)

    # ---- requests in and out ---------------------------------------------------------------------
    def add_request(self, request) -> None:
        rank = min(range(self.num_ranks), key=lambda r: (len(self.ranks[r].requests), r))
        self.ranks[rank].add_request(request)
        self._rank_of[request.request_id] = rank

    def finish_request(self, request_id: str, reason: str, stop_reason=None) -> bool:
        rank = self._rank_of.pop(request_id, None)
        return rank is not None and self.ranks[rank].finish_request(request_id, reason, stop_reason=stop_reason)

    def abort_request(self, request_id: str) -> bool:
        return self.finish_request(request_id, "abort")

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.ranks)

    @property
    def running(self) -> list:
        """Every rank's running requests, rank after rank (speculative decoding's proposers read them)."""
        return [req for s in self.ranks for req in s.running]

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.ranks)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.ranks)

    def stats(self):
        st = [s.stats() for s in self.ranks]
        return dataclasses.replace(
            st[0], num_running=sum(s.num_running for s in st), num_waiting=sum(s.num_waiting for s in st),
            kv_cache_usage=sum(s.kv_cache_usage for s in st) / len(st),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in st),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in st),
            num_preemptions=sum(s.num_preemptions for s in st))

    # ---- the step --------------------------------------------------------------------------------
    def schedule(self, group: int = 0) -> DPStepPlan:
        plans = [s.schedule(group) for s in self.ranks]  # each rank's requests of `group` (Scheduler.num_groups)
        plan = DPStepPlan(rank_plans=plans)
        for r, p in enumerate(plans):
            plan.seqs.extend(p.seqs)
            plan.ranks.extend([r] * len(p.seqs))
            plan.num_scheduled_tokens += p.num_scheduled_tokens
            plan.preempted_ids.extend(p.preempted_ids)
            plan.finished_ids.extend(p.finished_ids)
        return plan

    def update_from_output(self, plan: DPStepPlan, sampled: dict[str, int]):
        results = []
        for s, p in zip(self.ranks, plan.rank_plans):
            for req, new_ids, finished in s.update_from_output(p, sampled):
                if finished:
                    self._rank_of.pop(req.request_id, None)
                results.append((req, new_ids, finished))
        return results


def merge_rank_metas(metas: list, bucket: int):
    """Per-rank StepMetadata (each of `bucket` tokens and the same sequence rows) -> the whole step's, laid out rank
    after rank (merge_rank_steps); `logits_indices` made global: rank r's sampling rows (its sequence rows x
    Shapes.spec_width in a speculating step: its verify rows) read its tokens."""
    meta = type(metas[0])(**{  # the array fields; static ones (StepMetadata.has_context) keep their defaults,
        # optional ones a step does not carry (None) stay None
        f.name: None if getattr(metas[0], f.name) is None else
        np.concatenate([getattr(m, f.name) for m in metas], axis=0)
        for f in dataclasses.fields(metas[0]) if not f.metadata.get("static")})
    offsets = np.repeat(np.arange(len(metas), dtype=np.int32) * bucket, len(metas[0].logits_indices))
    return dataclasses.replace(meta, logits_indices=(meta.logits_indices + offsets).astype(np.int32))


def merge_rank_steps(metas: list, samplings: list, rank_seqs: list[list], bucket: int, seq_rows: int):
    """Per-rank padded host inputs (StepMetadata, SamplingTensors built for `bucket` tokens and
    `seq_rows` rows each) -> (StepMetadata, SamplingTensors, request_ids, sample_rows) of the whole
    step: rank r's tokens at [r * bucket, (r + 1) * bucket), its rows at [r * seq_rows, ...).
    request_ids has one entry per row (None for padding rows). With speculation each sequence row has
    Shapes.spec_width sampling rows (and logits_indices entries), so rank r's sampling rows start at
    r * seq_rows * spec_width; the MTP's next_token_ids (one a sequence row) are concatenated as the other fields."""
    meta = merge_rank_metas(metas, bucket)
    st = type(samplings[0])(**{  # optional fields a step does not carry (None) stay None
        f.name: None if getattr(samplings[0], f.name) is None else
        np.concatenate([getattr(s, f.name) for s in samplings], axis=0)
        for f in dataclasses.fields(samplings[0])})
    request_ids: list[str | None] = [None] * (len(metas) * seq_rows)
    sample_rows: list[int] = []
    for r, seqs in enumerate(rank_seqs):
        for i, s in enumerate(seqs):
            request_ids[r * seq_rows + i] = s.request_id
            if s.sample:
                sample_rows.append(r * seq_rows + i)
    return meta, st, request_ids, sample_rows
