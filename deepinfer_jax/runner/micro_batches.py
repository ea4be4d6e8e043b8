"""A pipelined step's micro-batches on the host (numpy only): which sequences each runs, its token bucket, and
where its logits rows go in the step's.

With pipeline parallelism (runner/pipeline.py) a step may run as M micro-batches, each through every stage, so
that stage s works on micro-batch k while stage s + 1 works on micro-batch k - 1 (GPipe's schedule). Each
micro-batch holds whole sequences (`split_balanced`: decode rows and prefill chunks spread by token count), is
padded to a bucket of the same ladder as whole steps (`Shapes.buckets`, whose stage programs warm-up compiled), and
every data-parallel rank splits its own sequences. Sampling runs once, on the whole step's rows: the micro-batches'
logits are gathered back into the step's row order (`gather_index`), so the sampler, the placeholders of the next
step (its rows) and the results are those of the step unsplit.

When to split (`choose`): a micro-batch costs each stage about what its padded bucket costs, so a step of bucket B
on N stages takes N x t(B) unsplit and (M + N - 1) x t(b) as M micro-batches of bucket b (the pipeline fills and
drains). With t proportional to the bucket's tokens (prefill: compute-bound) the split pays when (M + N - 1) x b <
N x B; decode buckets (no more token slots than sequence rows) are never split, since a decode step's time is mostly
reading the weights, the same for fewer rows, so M micro-batches would cost about M + N - 1 steps' reads instead of
N. M runs from 2 to N (the number of stages: more only lengthens the fill); the cheapest wins, ties to the fewer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepinfer_jax.runner.inputs import HostStep, Shapes


def split_balanced(token_counts: list[int], m: int) -> list[list[int]]:
    """Indices of `token_counts` in `m` parts of about equal token sums (largest first, each to the lightest part so
    far, ties to the lower part), each part in the original order. Every index lands in exactly one part."""
    parts: list[list[int]] = [[] for _ in range(m)]
    load = [0] * m
    for i in sorted(range(len(token_counts)), key=lambda i: -token_counts[i]):  # stable: ties in plan order
        k = min(range(m), key=lambda k: (load[k], k))
        parts[k].append(i)
        load[k] += token_counts[i]
    return [sorted(p) for p in parts]


def candidates(shapes: Shapes, bucket: int, stages: int) -> list[tuple[int, int]]:
    """Every (micro-batches M, their bucket b) that `choose` may pick for a step of `bucket` on `stages` stages:
    those cheaper than the step unsplit ((M + N - 1) x b < N x B) whose M buckets can hold a step that needs `bucket`
    (M x b above the ladder's bucket below it). Warm-up compiles their logits gathers."""
    if stages < 2 or bucket <= shapes.seq_rows(bucket):
        return []
    below = max([b for b in shapes.buckets if b < bucket], default=0)
    return [(m, b) for m in range(2, stages + 1) for b in shapes.buckets
            if b < bucket and m * b > below and (m + stages - 1) * b < stages * bucket]


@dataclass(frozen=True)
class MicroBatches:
    """A step's split: `parts[k][r]`, the indices (into rank r's sequences of the step) that micro-batch k runs;
    `bucket`, the token bucket of every micro-batch."""

    parts: tuple[tuple[tuple[int, ...], ...], ...]
    bucket: int

    @property
    def count(self) -> int:
        return len(self.parts)


def choose(groups: list[list[Any]], shapes: Shapes, bucket: int, stages: int) -> MicroBatches | None:
    """The cheapest split (module docstring) of a step whose rank r runs the sequences `groups[r]` (each with
    `token_ids`) in `bucket`; None to run it whole."""
    best, best_cost = None, stages * bucket
    most = max(len(g) for g in groups)
    allowed = candidates(shapes, bucket, stages)
    for m in sorted({m for m, _ in allowed}):
        if m > most:
            break  # a micro-batch of no sequence on any rank
        parts = [split_balanced([len(s.token_ids) for s in g], m) for g in groups]  # [rank][k]
        need = max(sum(len(g[i].token_ids) for i in p) for g, ps in zip(groups, parts) for p in ps)
        b = shapes.bucket_for(need)
        if (m, b) in allowed and (m + stages - 1) * b < best_cost:
            best_cost = (m + stages - 1) * b
            best = MicroBatches(tuple(tuple(tuple(ps[k]) for ps in parts) for k in range(m)), b)
    return best


def gather_index(split: MicroBatches, num_ranks: int, step_rows: int, micro_rows: int) -> np.ndarray:
    """int32 [num_ranks, step_rows]: for rank r's row i of the step, its row among rank r's rows of the micro-batches'
    logits (micro-batch k's j-th sequence of rank r at k x micro_rows + j), so that each data rank gathers from its
    own rows (no logits cross ranks); padding rows read row 0."""
    out = np.zeros((num_ranks, step_rows), np.int32)
    for k, ranks in enumerate(split.parts):
        for r, idx in enumerate(ranks):
            for j, i in enumerate(idx):
                out[r, i] = k * micro_rows + j
    return out


@dataclass
class PipelineStep(HostStep):
    """A HostStep run as micro-batches: each one's packed metadata ((layout, int32 inputs), in order), and the
    index (`gather_index`) that puts their logits rows back in the step's order for its sampler."""

    micro: tuple = ()
    micro_bucket: int = 0
    gather: np.ndarray | None = None

    @classmethod
    def of(cls, host: HostStep, micro, micro_bucket: int, gather: np.ndarray) -> "PipelineStep":
        fields = {f.name: getattr(host, f.name) for f in dataclasses.fields(HostStep)}
        return cls(**fields, micro=tuple(micro), micro_bucket=micro_bucket, gather=gather)
