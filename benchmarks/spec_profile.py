"""Where a speculating step's time goes (benchmarks/spec.py --profile): the engine's host time a step by phase,
the device time of the step program alone, and the step program's op counts, for K = 0 and each K.

`PhaseTimer(engine)` wraps the engine's phases with perf_counter timers (instance attributes and the speculative
module's `propose`; nothing in the engine changes):

  propose   the drafts before the plan (MTP bookkeeping, n-gram lookup, or the draft model's steps)
  schedule  Scheduler.schedule
  inputs    ModelRunner.prepare: the padded metadata and sampling tensors (K + 1 rows a sequence)
  launch    ModelRunner.run: packing, the host->device copy and the programs' dispatch
  wait      the blocking device->host read of the step's results (device time the host did not overlap)
  results   step_result: the fetched rows -> tokens by request
  update    Scheduler.update_from_output (accepted drafts appended, stops)
  emit      detokenizing, stop strings and RequestOutputs (LLMEngine._emit)

A plain step (K = 0) overlaps the device with the next step's host work (its `wait` is what is left over); a
speculating step is planned, run and fetched in turn, so its time is about the sum of the rows, unless it runs
the overlapped loop (RunnerConfig.spec_overlap, `--spec-overlap`: `update` then times its two halves,
scheduler/spec_overlap.py), where, as for a plain step, only `wait` is left over.

`device_ms(engine, host)`: the step program of HostStep `host` run alone `n` times back to back (the same inputs;
the KV cache's slots are written again with the same values), ms each: the device's time for the step where the
host keeps ahead of it. `op_counts(engine, host)`: counts of the optimized HLO's ops that tell the step programs
apart (dots, sorts, while loops, gathers, scatters, reductions, fusions: a launch-bound GPU pays for each kernel).
"""

from __future__ import annotations

import collections
import re
import time

PHASES = ("propose", "schedule", "inputs", "launch", "wait", "results", "update", "emit")


class PhaseTimer:
    """perf_counter time by phase over the steps the engine runs while `active`; `per_step()` -> ms a step."""

    def __init__(self, engine):
        from deepinfer_jax.engine import spec_overlap, speculative
        from deepinfer_jax.scheduler import spec_overlap as sched_overlap
        from deepinfer_jax.runner import model_runner

        self.engine, self.active, self.steps = engine, False, 0
        self.total = collections.defaultdict(float)
        self._spec = speculative
        self._propose = speculative.propose
        self._overlap, self._overlap_propose = spec_overlap, spec_overlap.propose  # RunnerConfig.spec_overlap's
        self._sched, self._sched_overlap = sched_overlap, {f: getattr(sched_overlap, f) for f in
                                                           ("apply_optimistic", "apply_fetched")}
        r, s = engine.runner, engine.scheduler
        s.schedule = self._wrap("schedule", s.schedule)
        s.update_from_output = self._wrap("update", s.update_from_output)
        self.last_host = None  # the last timed step's HostStep (`device_ms`, `op_counts`)
        prepare = self._wrap("inputs", r.prepare)

        def prepare_kept(*a, **kw):
            host = prepare(*a, **kw)
            if self.active:
                self.last_host = host
            return host

        r.prepare = prepare_kept
        r.run = self._wrap("launch", r.run)
        engine._emit = self._wrap("emit", engine._emit)
        step_result = model_runner.step_result

        def collect(host, out):
            t = time.perf_counter()
            fetched = out.to_host()
            t1 = time.perf_counter()
            res = step_result(host, fetched)
            self._add("wait", t1 - t)
            self._add("results", time.perf_counter() - t1)
            return res

        r.collect = collect

    def _add(self, phase: str, seconds: float) -> None:
        if self.active:
            self.total[phase] += seconds

    def _wrap(self, phase: str, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self._add(phase, time.perf_counter() - t)
        return timed

    def install_propose(self, proposer) -> None:
        """The speculative module's `propose` (the engine's own, or a benchmark's) under the timer."""
        self._spec.propose = self._wrap("propose", proposer or self._propose)
        self._overlap.propose = self._wrap("propose", self._overlap_propose)
        for f, fn in self._sched_overlap.items():  # the overlapped loop's two halves of update_from_output
            setattr(self._sched, f, self._wrap("update", fn))

    def restore_propose(self) -> None:
        self._spec.propose = self._propose
        self._overlap.propose = self._overlap_propose
        for f, fn in self._sched_overlap.items():
            setattr(self._sched, f, fn)

    def per_step(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {p: 1e3 * self.total.get(p, 0.0) / n for p in PHASES}

    def reset(self) -> None:
        self.total.clear()
        self.steps = 0


class StepsOnly:
    """PhaseTimer's interface without its wrappers (`spec.py --profile --no-phases`): the engine runs unobserved, so
    the step wall times are what a user's loop sees (a plain step's host work overlapped with its device time)."""

    active, steps, last_host = False, 0, None

    def install_propose(self, proposer) -> None:
        pass

    def restore_propose(self) -> None:
        pass

    def per_step(self) -> dict[str, float]:
        return {p: float("nan") for p in PHASES}

    def reset(self) -> None:
        self.steps = 0


def device_ms(engine, host, n: int = 20) -> float:
    """ms a run of HostStep `host`'s step program alone, `n` back to back (after one untimed)."""
    runner = engine.runner
    runner.run(host).block_until_ready()
    t = time.perf_counter()
    for _ in range(n):
        out = runner.run(host)
    out.block_until_ready()
    return 1e3 * (time.perf_counter() - t) / n


OPS = ("dot", "sort", "while", "gather", "scatter", "reduce", "custom-call", "fusion")


def op_counts(engine, host) -> dict[str, int]:
    """The compiled step program of `host` (its every program where the step is two): its optimized HLO's
    instructions by kind (OPS), over the whole module (entry and called computations; a fusion's body counts
    the ops fused into it, `fusion` the fusions themselves)."""
    from deepinfer_jax.runner.step_io import packed

    runner = engine.runner
    key = packed(host)[0]
    counts = collections.Counter()
    for pid in runner.programs.programs_of(key):
        text = runner.lower(pid).compile().as_text()
        for line in text.splitlines():
            m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(", line)
            if m:
                counts[m.group(1)] += 1
    return {name: counts.get(name, 0) for name in OPS}
