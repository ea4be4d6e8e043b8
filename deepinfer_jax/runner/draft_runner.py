"""The draft model of speculative decoding's `draft_model` method: its own ModelRunner, paged KV cache and step
programs, and the chained steps that propose each sequence's drafts (engine/spec_draft.py decides what each
sequence catches up on and keeps the per-request state).

The draft's cache mirrors the target's pages: a sequence's positions live at the same page ids in both pools, so
the scheduler's allocation (and its preemptions and frees) serves the draft as well. Its pool has the target's
`num_pages` plus `scratch_pages` pages for each sequence row: the positions a proposal writes past the pages the
scheduler has handed the request so far (its newest token and the drafts; the scheduler allocates them only when it
plans the step that verifies them) go to its row's scratch pages, and their KV counts for nothing afterwards.

`propose(items)` queues, without waiting in between:
  1. catch-up steps: each sequence's tokens the draft has not computed yet, all but a tail of each in chunks of at
     most the largest token bucket, sampling nothing;
  2. one step of every sequence's tail, sampling its first draft greedily at its newest token;
  3. K - 1 decode steps, each sequence's input the draft the step before sampled (a placeholder id the device
     resolves: runner/inputs.py `placeholder`), until it has its drafts.
Then it fetches the drafts. Every step runs the draft runner's compiled bucket programs (greedy rows: the base
variant, or the greedy one on decode buckets), so after warm-up nothing compiles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from deepinfer_jax.config import ModelConfig, RunnerConfig
from deepinfer_jax.models.registry import family_of, kv_cache_bytes_per_page
from deepinfer_jax.runner.inputs import Shapes, placeholder
from deepinfer_jax.runner.model_runner import ModelRunner
from deepinfer_jax.types import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class DraftItem:
    """One sequence to propose for: `token_ids` (the tokens the draft has not computed, its newest token last) at
    positions `start` ..; `page_ids`: the request's pages now (the scheduler's); `num_drafts` >= 1 to propose."""

    request_id: str
    token_ids: list[int]
    start: int
    page_ids: list[int]
    num_drafts: int


@dataclass
class _Seq:
    """What runner/inputs.py build_metadata and build_sampling read of a scheduled sequence."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    page_ids: list[int]
    sample: bool
    num_output_tokens: int = 0
    page_gen: int = 0
    num_draft_tokens: int = 0


@dataclass
class _GreedyRequest:
    """What the runner reads of a request for a draft row: greedy, nothing suppressed, no grammar."""

    sampling_params: SamplingParams = _GREEDY
    grammar: None = None
    num_output_tokens: int = 0
    eos_token_ids: tuple = ()
    prompt_token_ids: tuple = ()
    output_token_ids: tuple = ()


def draft_runner_config(cfg: ModelConfig, target: RunnerConfig) -> RunnerConfig:
    """The draft's RunnerConfig: the target's, with an attention implementation its family serves, a KV cache in the
    compute dtype, and no full sampling variant compiled at warm-up (draft rows are greedy, without logprobs)."""
    attn = target.attn_impl if target.attn_impl in family_of(cfg).attn_impls else "reference"
    return dataclasses.replace(target, attn_impl=attn, kv_cache_dtype="auto", warmup_full_variant=False,
                               collect_routing=False)


class DraftRunner:
    """The draft model's runner over a pool of `num_pages` pages mirroring the target's, plus the scratch pages."""

    def __init__(self, cfg: ModelConfig, params, runner_cfg: RunnerConfig, target_shapes: Shapes, num_pages: int,
                 num_speculative_tokens: int):
        self.cfg, self.k = cfg, num_speculative_tokens
        ps = target_shapes.page_size
        self.page_size, self.num_pages = ps, num_pages
        # positions past a request's pages: at most K (its newest token and K - 1 drafts), from a page boundary
        self.scratch_pages = cdiv(num_speculative_tokens, ps)
        self.shapes = Shapes(target_shapes.buckets, target_shapes.max_num_seqs, target_shapes.max_pages, ps,
                             target_shapes.max_model_len)
        self.max_tokens = self.shapes.buckets[-1]
        pool = num_pages + target_shapes.max_num_seqs * self.scratch_pages
        self.runner = ModelRunner(cfg, params, draft_runner_config(cfg, runner_cfg), self.shapes, pool)

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: str) -> int:
        return kv_cache_bytes_per_page(cfg, page_size, dtype)

    def warmup(self, progress: bool = True) -> int:
        return self.runner.warmup(progress=progress)

    @property
    def compiles_after_warmup(self) -> int:
        return self.runner.compiles_after_warmup

    def _pages(self, item: DraftItem, row: int, end: int) -> list[int]:
        """The item's page table covering positions < end: its own pages, then its row's scratch pages."""
        need = cdiv(end, self.page_size) - len(item.page_ids)
        if need > self.scratch_pages:
            raise ValueError(f"request {item.request_id}: {need} positions' pages past its own, the draft holds "
                             f"{self.scratch_pages}")
        first = self.num_pages + row * self.scratch_pages
        return list(item.page_ids) + list(range(first, first + max(need, 0)))

    def propose(self, items: list[DraftItem]) -> dict[str, list[int]]:
        """Each item's greedy drafts (module docstring), by request id."""
        if not items:
            return {}
        requests = {it.request_id: _GreedyRequest() for it in items}
        seeds = {it.request_id: 0 for it in items}
        ends = [it.start + len(it.token_ids) + it.num_drafts - 1 for it in items]  # positions written: < end
        pages = [self._pages(it, r, e) for r, (it, e) in enumerate(zip(items, ends))]
        share = max(1, self.max_tokens // len(items))
        tails = [min(len(it.token_ids), share) for it in items]
        # 1. the heads, packed into steps of at most the largest bucket
        step: list[_Seq] = []
        used = 0
        for it, tail, pg in zip(items, tails, pages):
            head, pos = it.token_ids[: len(it.token_ids) - tail], it.start
            while head:
                n = min(len(head), self.max_tokens - used)
                step.append(_Seq(it.request_id, head[:n], pos, pg, False))
                head, pos, used = head[n:], pos + n, used + n
                if used == self.max_tokens:
                    self.runner.dispatch(step, requests, seeds)
                    step, used = [], 0
        if step:
            self.runner.dispatch(step, requests, seeds)
        # 2. the tails, each sampling its first draft
        seqs = [_Seq(it.request_id, it.token_ids[len(it.token_ids) - t:], it.start + len(it.token_ids) - t, pg, True)
                for it, t, pg in zip(items, tails, pages)]
        inflight = [self.runner.dispatch(seqs, requests, seeds)]
        rows = {it.request_id: r for r, it in enumerate(items)}  # each sequence's row in the last step
        # 3. one decode step a further draft, fed the draft the step before sampled (on the device)
        for j in range(1, self.k):
            live = [(it, pg) for it, pg in zip(items, pages) if it.num_drafts > j]
            if not live:
                break
            pos = {it.request_id: it.start + len(it.token_ids) - 1 + j for it, _ in live}
            seqs = [_Seq(it.request_id, [placeholder(rows[it.request_id])], pos[it.request_id], pg, True)
                    for it, pg in live]
            inflight.append(self.runner.dispatch(seqs, requests, seeds))
            rows = {it.request_id: r for r, (it, _) in enumerate(live)}
        drafts: dict[str, list[int]] = {it.request_id: [] for it in items}
        for f in inflight:
            for rid, token in self.runner.fetch(f).token_ids.items():
                drafts[rid].append(token)
        return drafts
