"""Warm-up: every step program compiled (or loaded) before the first request, then each step run on padding.

`plan(runner)` lists the steps to run (one padding step a bucket and sampling variant, the mask variant with the
full one, both context variants where prefill buckets have them) and the programs they need
(step_programs.program_kind's ids), the slowest to compile first. `warm_up(runner)` traces and lowers the programs
one after another on the calling thread, from the params' abstract tree while the weights still load
(weights/pending.py), hands each to a pool of compile threads as soon as it is lowered, then takes the params and
runs each step `RunnerConfig.warmup_runs` times as soon as its programs are compiled. Afterwards the runner calls
the compiled executables directly and counts any compile as a recompile.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import jax

from deepinfer_jax.runner import program_cache
from deepinfer_jax.runner.inputs import HostStep
from deepinfer_jax.runner.step_io import packed
from deepinfer_jax.runner.step_programs import program_kind

log = logging.getLogger(__name__)


def _compile_rank(kind: str) -> int:
    """Warm-up lowers the programs in this order, the slowest to compile first so that the last to start compiling
    is short: the prefill buckets' shared forwards (24-32 s each on an H200's host beside the others), the whole
    step programs (13-22 s), then the shared forwards' samplers (0.1-1.5 s)."""
    return {"forward": 0, "step": 1, "sampler": 2}[kind]


def plan(runner) -> tuple[list[HostStep], dict[Any, tuple[int, str]]]:
    """The steps warm-up runs (one padding step a bucket and variant) and the programs it compiles for them: each
    program id (step_programs.program_kind) -> (its bucket, what it runs), in the order warm-up lowers them, the
    slowest to compile first (`_compile_rank`). `runner`: a ModelRunner."""
    variants = (False, True) if runner.runner_cfg.warmup_full_variant else (False,)
    platform = jax.default_backend()
    buckets = sorted(runner.shapes.buckets, key=lambda b: (not runner.runner_cfg.unroll_for(b, platform), -b))
    hosts = [runner.padding_step(b, full) for b in buckets for full in variants]
    hosts += [dataclasses.replace(h, greedy=True) for h in hosts
              if not h.penalties and runner.has_greedy_variant(h.bucket)]
    if runner.runner_cfg.warmup_full_variant and runner.has_mask_variant():  # its forward is the full variant's
        hosts += [runner.padding_step(b, False, masked=True) for b in buckets]
    # An empty plan is a step without cached context; where prefill buckets say so, the other variant too.
    hosts += [dataclasses.replace(h, meta=dataclasses.replace(h.meta, has_context=True)) for h in hosts
              if h.meta.has_context is False]
    programs: dict[Any, tuple[int, str]] = {}
    for host in hosts:
        key = packed(host)[0]
        for pid in runner.programs.programs_of(key):
            kind = program_kind(pid)[0]
            what = {"forward": "shared forward", "sampler": f"{key[1]} sampler"}.get(kind, f"{key[1]} step")
            programs.setdefault(pid, (host.bucket, what))
    order = sorted(programs, key=lambda pid: _compile_rank(program_kind(pid)[0]))  # stable: host order within
    return hosts, {pid: programs[pid] for pid in order}


def warm_up(runner, progress: bool = True) -> int:
    """Compile the step of every (bucket, sampling variant), and with RunnerConfig.prefill_context_variant
    of each prefill bucket's two context variants, then run each `warmup_runs` times on padding. Returns
    the number of programs compiled or loaded: with RunnerConfig.prefill_shared_forward a prefill bucket's
    steps count its forward once (a context variant) and each variant's sampler.

    With RunnerConfig.program_cache_dir (one device), programs stored there by an earlier start under
    the same key are loaded as they are (`programs_loaded`), on the compile threads; the others are
    compiled, and stored when XLA compiled them rather than JAX's compilation cache serving them
    (runner/program_cache.py). Programs are traced and lowered one after another on this thread (a
    bucket's forward is traced once for all its variants), from the params' abstract tree while they still
    load (weights/pending.py); each goes to a pool of compile threads as soon as it is lowered (XLA releases
    the GIL), the slowest first (`plan`). Then the params are awaited, and each step's runs on padding
    start as soon as its programs are compiled, while the others still compile. Steps then call the
    compiled executables directly."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    hosts, programs = plan(runner)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(programs), desc=f"compiling {len(programs)} step programs", unit="program",
                   leave=False, disable=None)

    cache_dir = runner.runner_cfg.program_cache_dir if runner.sharding is None else None
    device = jax.devices()[0]
    executables = runner.programs.executables

    def compile_one(pid, lowered, pkey):
        t = time.perf_counter()
        executables[pid], storable = program_cache.compile_program(lowered)
        bucket, what = programs[pid]
        log.info("warm-up: compiled the %s of %d tokens in %.1f s", what, bucket, time.perf_counter() - t)
        if pkey is not None and storable:
            program_cache.store(cache_dir, pkey, executables[pid])
        if bar is not None:
            bar.update(1)

    # On an empty cache most of the time goes to XLA's GEMM autotuning, timed on the device by all
    # threads at once (H200, serve's 16 programs: 170 s; 58 s from start to ready with the
    # autotuning results on disk, runner/compile_cache.py). Compiling base variants before full
    # ones, so that a bucket's second program found the first one's results, made no difference.
    workers = max(1, min(len(programs), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        state = runner.state_signature() if cache_dir else None
        pkeys = {pid: runner.programs.program_key(pid, state) if cache_dir else None for pid in programs}
        loads = {pid: pool.submit(program_cache.load, cache_dir, pkey, device) for pid, pkey in pkeys.items()
                 if pkey is not None}
        futures = {}
        for pid in programs:
            exe = loads[pid].result() if pid in loads else None
            if exe is not None:
                executables[pid] = exe
                runner.programs_loaded += 1
                if bar is not None:
                    bar.update(1)
                continue
            futures[pid] = pool.submit(compile_one, pid, runner.lower(pid), pkeys[pid])
        if runner.programs_loaded:
            log.info("warm-up: loaded %d step programs from %s in %.1f s", runner.programs_loaded, cache_dir,
                     time.perf_counter() - t0)
        runner.startup_seconds["lowered"] = time.perf_counter() - t0
        if futures:
            log.info("warm-up: traced and lowered %d step programs in %.1f s", len(futures),
                     time.perf_counter() - t0)
        runner.await_params()
        _runs(runner, hosts, futures)
    if bar is not None:
        bar.close()
    runner.startup_seconds["warmup"] = time.perf_counter() - t0
    return len(programs)


def _runs(runner, hosts: list[HostStep], compiling: dict) -> None:
    """Run each warm-up step RunnerConfig.warmup_runs times, one at a time (each finished before the next),
    each as soon as its programs are compiled (`compiling`: program id -> its compile's future; the others
    are ready). A failed compile raises here."""
    from concurrent.futures import FIRST_COMPLETED, wait

    waiting = list(hosts)
    while waiting:
        deps = {id(h): [compiling[p] for p in runner.programs.programs_of(packed(h)[0]) if p in compiling]
                for h in waiting}
        ready = [h for h in waiting if all(f.done() for f in deps[id(h)])]
        if not ready:
            wait({f for fs in deps.values() for f in fs if not f.done()}, return_when=FIRST_COMPLETED)
            continue
        for host in ready:
            for f in deps[id(host)]:
                f.result()
            try:
                for _ in range(max(1, runner.runner_cfg.warmup_runs)):
                    jax.block_until_ready(runner.run(host))
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                raise MemoryError(out_of_memory_message(runner, host)) from e
        waiting = [h for h in waiting if all(h is not r for r in ready)]


def out_of_memory_message(runner, host: HostStep) -> str:
    """What a warm-up step that ran out of device memory needed and what held the memory, with the settings that
    free it: the step's programs' temporaries (XLA's memory analysis of the compiled executables), the weights and
    the KV cache on the first device, and the allocator's limit (runner/device_memory.py)."""
    from deepinfer_jax.runner.device_memory import device_memory

    device = jax.devices()[0]

    def gib(b: int) -> str:
        return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"

    def on_device(tree) -> int:
        return sum(s.data.nbytes for a in jax.tree.leaves(tree) if isinstance(a, jax.Array)
                   for s in a.addressable_shards if s.device == device)

    temp = 0
    for pid in runner.programs.programs_of(packed(host)[0]):
        exe = runner.programs.executables.get(pid)
        analysis = exe.memory_analysis() if exe is not None else None
        temp = max(temp, getattr(analysis, "temp_size_in_bytes", 0) or 0)
    mem = device_memory(device)
    limit = "" if mem is None else f", of the {gib(mem.limit)} the allocator may hand out ({mem.source})"
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75, JAX's default")
    return (f"warm-up ran out of device memory in its step of {host.bucket} tokens: the step's program needs "
            f"{gib(temp)} of temporaries beside the weights ({gib(on_device(runner.params))}) and the KV cache "
            f"({gib(on_device(runner.kv_cache))}, {runner.num_pages} pages){limit}. Lower max_num_batched_tokens "
            f"(--max-num-batched-tokens) for smaller steps, or gpu_memory_utilization (--gpu-memory-utilization) "
            f"for a smaller KV cache, or raise XLA_PYTHON_CLIENT_MEM_FRACTION (now {fraction}).")
