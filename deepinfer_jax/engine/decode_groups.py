"""Decode groups: pipeline parallelism's steps in flight, one a stage, as vLLM's virtual engines keep them.

With N pipeline stages, one step at a time leaves each stage idle (N - 1) / N of a decode step: the next step needs
the tokens the last stage samples. So the running requests form N disjoint groups (Scheduler.num_groups: a request
joins the group that admits it and stays in it), and `LLMEngine.step` takes the groups in turn. Group g's step is
planned with placeholders for the tokens of group g's step before (PipelineRunner.select_group: each group's sampled
ids in a buffer of its own), queued, and only then is group g's step before fetched, N steps after it was queued.
Stage 0 of group g's step needs nothing of group g - 1's step but stage 0's cache, so it runs while that step is in
the later stages, and in steady decode every stage has a step to compute. Every stage runs its programs in the order
queued, so a step sees the KV pages every earlier step wrote (prefix hits, pages freed and reused) as before.
"""

from __future__ import annotations

from typing import Any


def set_decode_groups(engine: Any, n: int) -> None:
    """Run `engine` with `n` decode groups, 1 up to its runner's `decode_groups` (the number of pipeline stages);
    only while no request is unfinished and no step in flight."""
    most = getattr(engine.runner, "decode_groups", 1) if engine.spec is None else 1
    if not 1 <= n <= most:
        raise ValueError(f"decode groups must be in [1, {most}] (the pipeline stages; 1 with speculative decoding), "
                         f"got {n}")
    if engine.has_unfinished_requests():
        raise ValueError("set_decode_groups needs an idle engine (no request unfinished)")
    for pending in [engine._pending, *getattr(engine, "_group_pending", ())]:  # steps of finished requests only
        engine._pending = pending
        engine._emit(engine._fetch_pending())
    engine.groups, engine._group, engine._group_pending = n, 0, [None] * n
    for s in getattr(engine.scheduler, "ranks", [engine.scheduler]):
        s.num_groups = n
    if hasattr(engine.runner, "select_group"):
        engine.runner.select_group(0)


def grouped_step(engine: Any) -> list:
    """One `LLMEngine.step` of the next group (module docstring): its outputs are those of that group's step before."""
    g, engine._group = engine._group, (engine._group + 1) % engine.groups
    engine._pending = engine._group_pending[g]
    engine.runner.select_group(g)
    try:
        return engine._step(g)
    finally:
        engine._group_pending[g], engine._pending = engine._pending, None
        engine.max_steps_in_flight = max(engine.max_steps_in_flight,
                                         sum(p is not None for p in engine._group_pending))
