"""Pipeline stages: which decoder layers each stage runs, and a stage's share of the params tree.

Pipeline parallelism splits the decoder layers into `pp` contiguous stages (sharding/pipeline.py places each on
its own devices, runner/pipeline.py runs them one after another). The split is vLLM's (`get_pp_indices`):
every stage gets num_layers // pp layers, and the remainder goes one layer each to the stages just before the
last, which also carries the final norm and lm_head (7 layers on 4 stages: 2, 2, 2, 1). Stage 0 also carries the
embedding.

A stage's params are the full tree's with only its parts: `embed` on the first stage, `final_norm` and
`lm_head` on the last, and `segments` cut to its layers (`stage_segments`: the segments of models/params.py
that meet its range, each cut to the part inside it). Its KV cache holds its layers only, indexed from 0
(`StageSegment.local`). No MTP head: speculative decoding is refused with pipeline parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.params import Segment, layer_segments


def pp_layer_ranges(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `pp` stages (vLLM's get_pp_indices). ValueError when a stage would get no layer."""
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
    if num_layers < pp:
        raise ValueError(f"num_hidden_layers = {num_layers} is below --pipeline-parallel-size {pp} (every stage "
                         "needs a decoder layer); lower --pipeline-parallel-size")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    starts = [sum(parts[:i]) for i in range(pp)]
    return [(s, s + n) for s, n in zip(starts, parts)]


@dataclass(frozen=True)
class StageSegment:
    index: int  # the segment's index in params["segments"] of the whole model
    layers: Segment  # the part of it in the stage, in the model's layer numbers
    local: Segment  # the same layers numbered in the stage's KV cache (from 0)
    offset: int  # the first of them in the segment's stacked params


@dataclass(frozen=True)
class PipelineStage:
    """Stage `rank` of `size`, running decoder layers [start, stop)."""

    rank: int
    size: int
    start: int
    stop: int

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.stop - self.start


def pipeline_stages(cfg: ModelConfig, pp: int) -> list[PipelineStage]:
    return [PipelineStage(r, pp, a, b) for r, (a, b) in enumerate(pp_layer_ranges(cfg.num_hidden_layers, pp))]


def param_segments(cfg: ModelConfig) -> tuple[Segment, ...]:
    """The layers of each entry of params["segments"]: models/params.py's segments; the dense family (models/dense.py)
    stacks all its layers in one."""
    return (Segment("dense", 0, cfg.num_hidden_layers),) if cfg.family == "dense" else layer_segments(cfg)


def stage_segments(cfg: ModelConfig, stage: PipelineStage) -> list[StageSegment]:
    """The entries of params["segments"] that meet the stage's layers, each cut to them."""
    out = []
    for i, seg in enumerate(param_segments(cfg)):
        a, b = max(seg.start, stage.start), min(seg.stop, stage.stop)
        if a < b:
            out.append(StageSegment(i, Segment(seg.kind, a, b), Segment(seg.kind, a - stage.start, b - stage.start),
                                    a - seg.start))
    return out


def stage_tree(tree: dict, cfg: ModelConfig, stage: PipelineStage, cut: Callable[[Any, int, int], Any] | None = None
               ) -> dict:
    """The stage's part of a params-shaped `tree` (params, specs or shardings). `cut(segment subtree, offset,
    length)` cuts a stacked segment to the stage's layers (None: the segment's subtree as it is, as for
    shardings, whose layer axis is never split)."""
    segs = []
    for s in stage_segments(cfg, stage):
        sub = tree["segments"][s.index]
        segs.append(sub if cut is None else cut(sub, s.offset, s.local.num_layers))
    out: dict[str, Any] = {"segments": segs}
    if stage.first:
        out["embed"] = tree["embed"]
    if stage.last:
        out["final_norm"], out["lm_head"] = tree["final_norm"], tree["lm_head"]
    return out
