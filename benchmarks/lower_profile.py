"""Where warm-up's tracing and lowering time goes: `serve`'s step programs (Protocol B's flags by default)
traced and lowered one after another under cProfile, without compiling them. Warm-up does this part on
one thread while the compile threads work, so its total is the least a cold start spends before the last
program can start compiling.

    python benchmarks/lower_profile.py [--no-prefill-shared-forward] [--top 30] [--limit N]
        [--pick "2048 shared forward,32 base step"] [--compile]
    python benchmarks/lower_profile.py --dense llama-3.1-8b --layers 4 --cuda --max-num-seqs 32 \
        --max-model-len 784                # Protocol A-dense's programs, lowered for an H100 on this CPU

Prints each program's trace-and-lower seconds, then the profile's functions by own time and by
cumulative time. `--compile`: each program is then compiled alone, one after another (a fresh compilation
cache seeded with the shipped autotuning results, as `serve`'s first start), with its wall seconds and the
process's CPU seconds (every thread's): what it costs the machine, against what warm-up's 16 threads share.

`--dense SHAPE`: a dense family's shape (benchmarks/dense.py SHAPES) in place of `--preset`; `--layers N` cuts either
to N layers. `--cuda`: lowered for CUDA (an sm_90 device assumed) with the Pallas kernels and the GPU's layer loops
(unrolled up to 256 token slots, indexed above), as warm-up lowers them on a GPU, on any machine (no `--compile`).
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
    ap.add_argument("--dense", default=None, help="a benchmarks/dense.py shape (e.g. llama-3.1-8b) instead")
    ap.add_argument("--layers", type=int, default=0, help="cut the model to this many layers")
    ap.add_argument("--cuda", action="store_true", help="lower for CUDA with the GPU's kernels and layer loops")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--unroll-max-tokens", type=int, default=None, help="RunnerConfig.unroll_max_tokens (--cuda: 256)")
    ap.add_argument("--decode-shared-forward", action=argparse.BooleanOptionalAction, default=False,
                    help="RunnerConfig.decode_shared_forward")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
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
    if args.cuda and args.compile:
        ap.error("--compile compiles for this machine's device: not with --cuda")

    import json

    from benchmarks.dense import SHAPES
    from deepinfer_jax.engine.llm import LLM
    from deepinfer_jax.runner.model_runner import ModelRunner
    from deepinfer_jax.weights.pending import PendingParams

    prof = cProfile.Profile()
    rows, compiled = [], []

    if args.cuda:  # Pallas-Triton's lowering asks the GPU for its compute capability (tests/kernels/conftest.py)
        from jax._src.pallas.triton import pallas_call_registration as reg

        class _SM90:
            compute_capability = 90

        reg.gpu_info_lib.get_gpu_info = lambda: _SM90()

    def lower(runner, pid):
        traced = runner.trace(pid)
        return traced.lower(lowering_platforms=("cuda",)) if args.cuda else traced.lower()

    def warmup(self, progress=True):
        _, programs = self.warmup_plan()
        picks = [p for p in args.pick.split(",") if p]
        pids = [pid for pid in programs if not picks or any(p in "%d %s" % programs[pid] for p in picks)]
        for pid in pids[: args.limit or None]:
            t = time.perf_counter()
            prof.enable()
            lowered = lower(self, pid)
            prof.disable()
            rows.append((programs[pid], time.perf_counter() - t))
            if args.compile:
                t, c = time.perf_counter(), time.process_time()
                lowered.compile()
                compiled.append((programs[pid], time.perf_counter() - t, time.process_time() - c))
        raise _Planned

    ModelRunner.warmup = warmup
    # The programs need only the weights' shapes: their load (a draw of random ones) is left out of the profile.
    PendingParams.start = lambda self: None
    if args.dense is not None:
        if args.dense not in SHAPES:
            ap.error(f"--dense {args.dense!r} is not one of {sorted(SHAPES)}")
        config = dict(SHAPES[args.dense])
    else:
        with open(os.path.join(os.path.dirname(HERE), "configs", "models", f"{args.preset}.json")) as f:
            config = json.load(f)
    if args.layers:
        config["num_hidden_layers"] = args.layers
    model = tempfile.mkdtemp()
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    gpu = dict(attn_impl="pallas", moe_impl="pallas", unroll_max_tokens=256, prefill_layers="indexed")
    if args.unroll_max_tokens is not None:
        gpu["unroll_max_tokens"] = args.unroll_max_tokens
    knobs = gpu if args.cuda else {"unroll_max_tokens": args.unroll_max_tokens}
    try:
        LLM(model, load_format="dummy", max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
            compilation_cache_dir=tempfile.mkdtemp() if args.compile else None, skip_tokenizer_init=True,
            progress=False, prefill_shared_forward=args.prefill_shared_forward,
            decode_shared_forward=args.decode_shared_forward, **knobs)
    except _Planned:
        pass
    kinds = {}
    for (_, what), _ in rows:
        kind = what.split()[-1]
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f"{config['architectures'][0]}, {config['num_hidden_layers']} layers: {len(rows)} programs "
          f"({', '.join(f'{n} {k}' for k, n in kinds.items())})")
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
