"""Where warm-up's tracing and lowering time goes: `serve`'s step programs (Protocol B's flags by default)
traced and lowered one after another under cProfile, without compiling them. Warm-up does this part on
one thread while the compile threads work, so its total is the least a cold start spends before the last
program can start compiling.

    python benchmarks/lower_profile.py [--no-prefill-shared-forward] [--top 30] [--limit N]
        [--pick "2048 shared forward,32 base step"] [--compile]

Prints each program's trace-and-lower seconds, then the profile's functions by own time and by
cumulative time. `--compile`: each program is then compiled alone, one after another (a fresh compilation
cache seeded with the shipped autotuning results, as `serve`'s first start), with its wall seconds and the
process's CPU seconds (every thread's): what it costs the machine, against what warm-up's 16 threads share.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


class _Planned(Exception):
    pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--prefill-shared-forward", action=argparse.BooleanOptionalAction, default=True,
                    help="RunnerConfig.prefill_shared_forward")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--limit", type=int, default=0, help="lower only the first N programs")
    ap.add_argument("--pick", default="", help="only the programs whose 'bucket what' (e.g. '2048 shared forward') "
                                               "contains one of these comma-separated texts")
    ap.add_argument("--compile", action="store_true", help="then compile each alone (wall and CPU seconds)")
    args = ap.parse_args(argv)

    from benchmarks.dummy_model import write_dummy_model
    from deepinfer_jax.engine.llm import LLM
    from deepinfer_jax.runner.model_runner import ModelRunner

    prof = cProfile.Profile()
    rows, compiled = [], []

    def warmup(self, progress=True):
        _, programs = self.warmup_plan()
        picks = [p for p in args.pick.split(",") if p]
        pids = [pid for pid in programs if not picks or any(p in "%d %s" % programs[pid] for p in picks)]
        for pid in pids[: args.limit or None]:
            t = time.perf_counter()
            prof.enable()
            lowered = self.lower(pid)
            prof.disable()
            rows.append((programs[pid], time.perf_counter() - t))
            if args.compile:
                t, c = time.perf_counter(), time.process_time()
                lowered.compile()
                compiled.append((programs[pid], time.perf_counter() - t, time.process_time() - c))
        raise _Planned

    ModelRunner.warmup = warmup
    model = tempfile.mkdtemp()
    write_dummy_model(os.path.join(os.path.dirname(HERE), "configs", "models", f"{args.preset}.json"), model)
    try:
        LLM(model, load_format="dummy", max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            compilation_cache_dir=tempfile.mkdtemp() if args.compile else None, skip_tokenizer_init=True,
            progress=False,
            prefill_shared_forward=args.prefill_shared_forward)
    except _Planned:
        pass
    print("| bucket | program | traced and lowered, s |\n|---|---|---|")
    for (bucket, what), sec in rows:
        print(f"| {bucket} | {what} | {sec:.2f} |")
    print(f"| all | {len(rows)} programs | {sum(s for _, s in rows):.1f} |")
    if compiled:
        print("| bucket | program | compiled alone, s | CPU s (all threads) |\n|---|---|---|---|")
        for (bucket, what), sec, cpu in compiled:
            print(f"| {bucket} | {what} | {sec:.1f} | {cpu:.1f} |")
        print(f"| all | {len(compiled)} programs | {sum(r[1] for r in compiled):.1f} | "
              f"{sum(r[2] for r in compiled):.1f} |")
    from deepinfer_jax.runner.lowering import speed_up_kernel_lowering

    cache = speed_up_kernel_lowering()
    if cache is not None:
        print(f"Triton lowerings: {cache.misses} made, {cache.hits} hits")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top * 2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
