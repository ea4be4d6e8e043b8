"""Protocol A (BENCHMARKS.md): offline generation, batch 32, 512 random prompt ids, 256 output tokens,
ignore EOS, greedy and temperature 1.0; the V2-Lite shape with random weights on a GPU, a tiny preset
on a CPU.

    python benchmarks/offline.py                       # GPU: deepseek-v2-lite shape
    python benchmarks/offline.py --preset tiny-deepseek-v2 --batch 8 --prompt-len 64 --output-len 16   # CPU

Prints start-up time (weights + warm-up compiles), batch prefill time (1 output token), Protocol A
output tokens/s with the roofline beside it, peak device memory, the mean number of distinct experts
touched per MoE layer per decode step and the number of distinct output tokens (collapsed routing
would make both small and the speed meaningless).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.runner_flags import add_variant_flags, variant_kwargs  # noqa: E402

from deepinfer_jax.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig  # noqa: E402
from deepinfer_jax.types import RequestOutputKind, SamplingParams  # noqa: E402

FINAL_ONLY = RequestOutputKind.FINAL_ONLY  # only finished outputs are read, as vLLM's LLM.generate

HBM_BYTES_PER_S = {"H200": 4.3e12, "H100": 3.35e12}  # the H200's measured device-to-device copy (GPU.md), the
# H100's datasheet: the decode step's weight-byte floor on the card that runs
BF16_FLOPS = 587e12  # measured XLA bf16 matmul on the H200


def weight_bytes_per_decode_step(cfg: ModelConfig, params, distinct_experts: float) -> float:
    """Bytes a decode step must read: every weight array of `params` (quantized codes and scales as stored) except
    unused experts and all but `batch` embedding rows."""
    import jax

    total = 0
    for path, x in jax.tree.flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        n = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        if "'embed'" in name and "segments" not in name:
            continue
        if "experts" in name:
            n = n * distinct_experts / cfg.n_routed_experts
        total += n
    return total


def cuda_stack_limit(device, new: int | None = None) -> str:
    """The context's CU_LIMIT_STACK_SIZE (bytes a thread) as the driver has it, then set to `new` if given.
    Printed because a kernel that needs a larger stack grows the context's local memory for good, which is one
    suspect for decode steps running slower while a scanned step program is loaded."""
    import ctypes

    from deepinfer_jax.runner.device_memory import cuda_mem_info

    if cuda_mem_info(device) is None:  # also makes JAX's context current on this thread
        return "unknown (no CUDA driver)"
    cuda, value = ctypes.CDLL("libcuda.so.1"), ctypes.c_size_t()
    if cuda.cuCtxGetLimit(ctypes.byref(value), 0):
        return "unknown (cuCtxGetLimit failed)"
    text = f"{value.value} bytes"
    if new is not None:
        rc = cuda.cuCtxSetLimit(0, ctypes.c_size_t(new))
        cuda.cuCtxGetLimit(ctypes.byref(value), 0)
        text += f", set to {new}: {value.value} bytes (rc {rc})"
    return text


def quantized_params(cfg: ModelConfig, params, method: str, dtype, scale: float = 0.05, seed: int = 1):
    """Protocol A's weights in a quantized format (`--quantization`), drawn on the device at the float dummy's scale
    (about U(-scale, scale) once dequantized): "fp8" as an FP8 release of the shape (128 x 128 blocks, every leaf the
    loader keeps as FP8: weights/release_random.py; the format `--quantization fp8` gives a float checkpoint online);
    "int8" / "int4" as the QuantizedWeight codes of models/quant.py's layouts (per-channel INT8, INT4 in groups of at
    most 128, as `convert --quantize` writes them) in place of `params`' float leaves."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.models.quant import METHODS, QuantizedWeight, quant_layout, quantized_shapes

    if method == "fp8":  # `params` unused (None)
        from deepinfer_jax.weights.release_random import Fp8Release, pending_release_params

        return pending_release_params(cfg, Fp8Release((128, 128)), dtype, seed=seed, scale=scale).load()
    bits = METHODS[method]
    key = jax.random.key(seed)

    def one(i, path, leaf):  # leaf i of the tree's order: the same draws in every process
        keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        lay = quant_layout(keys)
        if lay is None:
            return leaf
        q_shape, s_shape, g = quantized_shapes(leaf.shape, bits, lay[0], lay[1], 128)
        q = codes(jax.random.fold_in(key, i), q_shape)
        leaf.delete()  # the float leaf's bytes back before the next draw: both trees at once would not fit
        s = jnp.full(s_shape, scale / (127 if bits == 8 else 8), jnp.float32)
        return QuantizedWeight(q, s, bits, g, lay[1])

    def draw(k, shape):
        if bits == 8:  # codes in [-127, 127] x scale / 127
            return jax.random.randint(k, shape, -127, 128, jnp.int8)
        return jax.random.randint(k, shape, 0, 256, jnp.int32).astype(jnp.uint8)  # two codes a byte, each in [0, 15]

    @functools.partial(jax.jit, static_argnums=1)
    def codes(k, shape):  # a stacked leaf a slice at a time: the draw's 32-bit temporaries stay one slice's
        if len(shape) < 3:
            return draw(k, shape)
        return jax.lax.map(lambda kk: draw(kk, shape[1:]), jax.random.split(k, shape[0]))

    leaves, treedef = jax.tree.flatten_with_path(params)
    return jax.tree.unflatten(treedef, [one(i, path, leaf) for i, (path, leaf) in enumerate(leaves)])


PRESETS = sorted(f[:-5] for f in os.listdir(os.path.join(os.path.dirname(HERE), "configs", "models"))
                 if f.endswith(".json"))


def _csv(kind, check):
    """A parser of comma-separated values, each through `check` (an argparse type function of server/args.py)."""
    def parse(text: str) -> tuple:
        out = tuple(check(t.strip()) for t in text.split(",") if t.strip())
        if not out:
            raise argparse.ArgumentTypeError(f"must be comma-separated {kind}, got {text!r}")
        return out
    return parse


def _steps(text: str) -> tuple[int, int]:
    try:
        first, last = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be FIRST:LAST (integers), got {text!r}") from None
    return first, last


def main(argv=None, prog: str | None = None) -> int:
    from deepinfer_jax.server.args import (ArgParser, nonnegative_float, nonnegative_int, positive_int,
                                           power_of_two)

    ap = ArgParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v2-lite", choices=PRESETS, help="a model of configs/models")
    ap.add_argument("--batch", type=positive_int, default=32)
    ap.add_argument("--prompt-len", type=positive_int, default=512)
    ap.add_argument("--output-len", type=positive_int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--quantization", default="none", choices=["none", "fp8", "int8", "int4"],
                    help="weights drawn in this format (`quantized_params`): fp8 as an FP8 block-scaled release, "
                         "int8 / int4 as `convert --quantize` writes them; none: float weights in --dtype")
    ap.add_argument("--attn-impl", default="pallas", choices=["pallas", "pallas_interpret", "reference"])
    ap.add_argument("--moe-impl", default="pallas", choices=["pallas", "pallas_interpret", "ragged", "dense"])
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=16384,
                    help="the token budget of a step; 16384 is vLLM's default for its LLM class on an H200 (>= 70 GiB), so a "
                         "Protocol A prefill of 32 x 512 is one step in both engines")
    ap.add_argument("--page-size", type=power_of_two, default=64)
    ap.add_argument("--max-model-len", type=positive_int, default=1024)
    ap.add_argument("--buckets", type=_csv("positive integers", positive_int), default=(),
                    help="comma-separated token buckets (default: powers of two)")
    ap.add_argument("--temperatures", type=_csv("numbers >= 0", nonnegative_float), default=(0.0, 1.0))
    ap.add_argument("--runs", type=positive_int, default=2)
    ap.add_argument("--json", default="", help="write the figures to this file")
    ap.add_argument("--warmup-runs", type=positive_int, default=None,
                    help="runs of each step program at warm-up (RunnerConfig.warmup_runs)")
    ap.add_argument("--routing", choices=["host", "device", "off"], default="host",
                    help="the routed expert ids behind the experts-touched figure: read to the host one step "
                         "later, as the sampled ids are (host), kept on the device until the run ends (device: "
                         "a fresh output buffer every step), or not returned by the step "
                         "at all (off: an A/B of what collecting them costs)")
    ap.add_argument("--early-copy", action=argparse.BooleanOptionalAction, default=True,
                    help="start each step's device-to-host copy of its sampled ids at dispatch (the engine's way); "
                         "off: the copy starts when the host fetches them, a step later (an A/B)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="after start-up, gc.collect() then gc.freeze(): the cyclic collector then skips everything "
                         "the start made (vLLM's way); the runs print the collections' pauses either way")
    ap.add_argument("--prompt-seed", type=int, default=0,
                    help="the random prompts' seed: another seed, another decode trajectory (and routing)")
    ap.add_argument("--cuda-stack-limit", type=int, default=None,
                    help="after warm-up, set the CUDA context's per-thread stack limit (CU_LIMIT_STACK_SIZE, bytes; "
                         "the driver raises it for any kernel that needs more and never lowers it); the value "
                         "before and after is printed on a GPU either way")
    ap.add_argument("--unroll-max-tokens", type=nonnegative_int, default=None,
                    help="steps of at most this many token slots run their layers unrolled (RunnerConfig."
                         "unroll_max_tokens; default 256 on a GPU: the prefill bucket runs as --prefill-layers says)")
    add_variant_flags(ap)
    ap.add_argument("--trace", default="",
                    help="after the runs, trace 20 decode steps of one more run into this folder and print the "
                         "device's busy / idle time per step and the kernels (benchmarks/trace_tools.py)")
    ap.add_argument("--trace-steps", type=_steps, default=None,
                    help="with --trace: the engine steps to trace, FIRST:LAST (1-based, LAST exclusive; 1:0 = the "
                         "whole run, prefill included), and a per-step timeline of their periods")
    ap.add_argument("--tensor-parallel-size", type=positive_int, default=1)
    ap.add_argument("--data-parallel-size", type=positive_int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.runner.compile_cache import enable_compilation_cache
    from deepinfer_jax.weights.random_init import random_params

    enable_compilation_cache("default")
    cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(HERE), "configs", "models", f"{args.preset}.json"))
    dev = jax.devices()[0]
    card = "H100" if "H100" in dev.device_kind else "H200"  # other cards: the H200's floor, so named
    hbm = HBM_BYTES_PER_S[card]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}", flush=True)
    from deepinfer_jax.sharding import ParallelConfig, build_sharding

    parallel = ParallelConfig(args.tensor_parallel_size, args.data_parallel_size, args.enable_expert_parallel)
    sharding = None if parallel.is_single_device else build_sharding(cfg, parallel)
    dp = args.data_parallel_size
    t0 = time.time()
    if args.quantization != "none" and sharding is not None:
        ap.error("--quantization runs on one device")
    params = None
    if args.quantization != "fp8":
        params = random_params(cfg, jnp.dtype(args.dtype), seed=0,
                               shardings=None if sharding is None else sharding.param_shardings(cfg))
    if args.quantization != "none":
        params = quantized_params(cfg, params, args.quantization, jnp.dtype(args.dtype))
    jax.block_until_ready(params)
    t_weights = time.time() - t0
    # With data-parallel attention the scheduler limits and buckets hold per rank.
    buckets = tuple(b // dp for b in args.buckets)
    eng = LLMEngine(
        cfg, params, None, sharding=sharding,
        scheduler_config=SchedulerConfig(max_num_seqs=args.batch // dp,
                                         max_num_batched_tokens=args.max_num_batched_tokens // dp,
                                         max_model_len=args.max_model_len),
        cache_config=CacheConfig(page_size=args.page_size, enable_prefix_caching=False, gpu_memory_utilization=0.85),
        runner_config=RunnerConfig(dtype=args.dtype, attn_impl=args.attn_impl, moe_impl=args.moe_impl,
                                   **variant_kwargs(args),
                                   token_buckets=buckets, warmup_full_variant=False,
                                   unroll_max_tokens=args.unroll_max_tokens,
                                   collect_routing=args.routing != "off",
                                   **({} if args.warmup_runs is None else {"warmup_runs": args.warmup_runs})),
        progress=False)
    t_ready = time.time() - t0
    if dev.platform == "gpu":
        print(f"CUDA stack limit after warm-up: {cuda_stack_limit(dev, args.cuda_stack_limit)}", flush=True)
    from deepinfer_jax.models.quant import weights_nbytes

    print(f"weights: {args.quantization if args.quantization != 'none' else args.dtype}, "
          f"{weights_nbytes(params) / 2**30:.2f} GiB", flush=True)
    print(f"start-up: weights {t_weights:.1f}s, ready {t_ready:.1f}s ({eng.num_warmup_compiles} shapes), "
          f"KV cache {eng.kv_cache_report}", flush=True)

    if not args.early_copy:
        from deepinfer_jax.runner.model_runner import StepOut

        StepOut.copy_to_host_async = lambda self: None
    import gc

    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    gc_pauses: list[tuple[int, float]] = []  # (generation, seconds) of each collection during the runs
    gc_start = [0.0]

    def gc_timer(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_pauses.append((info["generation"], time.perf_counter() - gc_start[0]))

    gc.callbacks.append(gc_timer)
    timers = {"dispatch": 0.0, "fetch": 0.0, "steps": 0}
    for name in ("dispatch", "fetch"):  # host time in each runner call (fetch = waiting for the device)
        def timed(*a, _f=getattr(eng.runner, name), _n=name, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                timers[_n] += time.perf_counter() - t
        setattr(eng.runner, name, timed)

    rng = np.random.default_rng(args.prompt_seed)
    prompts = [rng.integers(100, min(cfg.vocab_size, 100000), args.prompt_len).tolist() for _ in range(args.batch)]
    counter = [0]

    def run(n_out: int, temp: float, trace_steps: tuple[int, int] | None = None):
        experts, pending, seen = [], None, None
        for p in prompts:
            counter[0] += 1
            eng.add_request(f"r{counter[0]}", p, SamplingParams(temperature=temp, max_tokens=n_out, ignore_eos=True,
                                                                 seed=counter[0], output_kind=FINAL_ONLY))
        outs = {}
        timers.update(dispatch=0.0, fetch=0.0, steps=0)
        gc_pauses.clear()
        t = time.time()
        while eng.has_unfinished_requests():
            timers["steps"] += 1
            if trace_steps and timers["steps"] == trace_steps[0]:
                jax.profiler.start_trace(args.trace, create_perfetto_trace=True)
            if trace_steps and timers["steps"] == trace_steps[1] > 0:
                jax.profiler.stop_trace()
            plan_tokens = None
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
            routing = eng.runner.last_routing
            plan_tokens = eng.runner.last_num_tokens
            if pending is not None:  # the step before this one has finished: no stall
                experts.append(np.asarray(pending))
                pending = None
            fresh, seen = routing is not seen, routing  # a step that queued nothing leaves the last one
            if routing is not None and fresh and plan_tokens == len(prompts) and n_out > 1:
                if args.routing == "device":
                    experts.append(routing)  # kept on the device: reading it now would stall the overlap
                else:
                    routing.copy_to_host_async()
                    pending = routing
        dt = time.time() - t
        if trace_steps and (trace_steps[1] <= 0 or timers["steps"] < trace_steps[1]):
            jax.profiler.stop_trace()  # the window ran to the end of the run
        if pending is not None:
            experts.append(np.asarray(pending))
        if n_out > 16:
            pauses = [p for g, p in gc_pauses]
            print(f"  garbage collections during the run: {len(pauses)} (gen 2: {sum(g == 2 for g, _ in gc_pauses)}), "
                  f"{sum(pauses) * 1e3:.1f} ms in all, longest {max(pauses, default=0) * 1e3:.2f} ms"
                  f"{', objects frozen: %d' % gc.get_freeze_count() if args.gc_freeze else ''}", flush=True)
            n = max(1, timers["steps"])
            print(f"  engine loop: {n} steps, {dt / n * 1e3:.2f} ms/step: dispatch {timers['dispatch'] / n * 1e3:.2f} ms, "
                  f"waiting in fetch {timers['fetch'] / n * 1e3:.2f} ms, other host {(dt - timers['dispatch'] - timers['fetch']) / n * 1e3:.2f} ms",
                  flush=True)
        sampled = [np.asarray(x)[:, : len(prompts)] for x in experts[:: max(1, len(experts) // 16)]]
        experts = [np.mean([len(np.unique(layer)) for layer in r]) for r in sampled]
        if sampled and n_out > 16:  # the MoE kernels read an expert's weights once per 16-row block
            counts = [np.bincount(layer.ravel(), minlength=cfg.n_routed_experts) for r in sampled for layer in r]
            print(f"  routed row blocks of 16 per layer per step {np.mean([np.sum(-(-c // 16)) for c in counts]):.1f}, "
                  f"most copies of one expert {np.mean([c.max() for c in counts]):.1f} (mean), "
                  f"{max(c.max() for c in counts)} (max)", flush=True)
        toks = [o.outputs[0].token_ids for o in outs.values()]
        assert all(len(x) == n_out for x in toks)
        distinct = len({x for t in toks for x in t[-64:]})
        return dt, (float(np.mean(experts)) if experts else float("nan")), distinct

    run(4, 0.0)  # touch every path once more after warm-up
    results = {"preset": args.preset, "startup_s": t_ready, "compiles_after_warmup": 0,
               "parallel": [args.tensor_parallel_size, dp, args.enable_expert_parallel]}
    print(f"layout: TP={args.tensor_parallel_size} DP={dp} EP={args.enable_expert_parallel}", flush=True)
    t_prefill = min(run(1, 0.0)[0] for _ in range(2))
    results["prefill_ms"] = t_prefill * 1e3
    active = 2 * 2.4e9 if args.preset == "deepseek-v2-lite" else None
    line = f"prefill {args.batch}x{args.prompt_len}: {t_prefill * 1e3:.0f} ms"
    if active:
        line += f" (compute floor {active * args.batch * args.prompt_len / BF16_FLOPS * 1e3:.0f} ms)"
    print(line, flush=True)
    for temp in args.temperatures:
        runs = [run(args.output_len, temp) for _ in range(args.runs)]
        best = min(r[0] for r in runs)
        experts, distinct = runs[0][1], runs[0][2]
        tps = args.batch * args.output_len / best
        floor_step = weight_bytes_per_decode_step(cfg, params, experts) / hbm
        limit = args.batch / floor_step
        print(f"Protocol A temp={temp}: {best:.2f}s -> {tps:,.0f} output tok/s (decode-only limit at the "
              f"{card}'s {hbm / 1e12:.2f} TB/s {limit:,.0f}; runs {', '.join(f'{r[0]:.2f}' for r in runs)}); "
              f"distinct experts/layer/step {experts:.1f} of "
              f"{cfg.n_routed_experts}; distinct tokens (last 64 steps) {distinct}", flush=True)
        # A decode step's floors at this batch: its weight bytes over HBM bandwidth, its FLOPs over the bf16
        # matmul rate. At 128-512 sequences the MoE turns compute-bound, where the second floor takes over.
        step_ms = (best - t_prefill) / max(1, args.output_len - 1) * 1e3
        flops_ms = active * args.batch / BF16_FLOPS * 1e3 if active else float("nan")
        print(f"  decode step {step_ms:.2f} ms (the run less its prefill, over {args.output_len - 1} steps); floors: "
              f"weight bytes {floor_step * 1e3:.2f} ms, FLOPs {flops_ms:.2f} ms", flush=True)
        results[f"temp{temp}"] = {"seconds": best, "tok_s": tps, "limit_tok_s": limit, "experts": experts,
                                  "distinct_tokens": distinct}
    if args.trace:
        from benchmarks.trace_tools import print_report

        moe_layers = sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers)))
        if args.trace_steps:
            first, last = args.trace_steps
        else:
            first = max(2, args.output_len // 2 - 10)
            last = first + 20
        run(args.output_len, 0.0, (first, last))
        print(f"engine trace, steps {first}-{last if last > 0 else 'end'}:")
        print_report(args.trace, moe_layers, top=25)
        if args.trace_steps:
            from benchmarks.trace_tools import gpu_kernels, print_step_timeline

            prefill_steps = -(-args.batch * args.prompt_len // args.max_num_batched_tokens)
            print_step_timeline(gpu_kernels(args.trace) or [], moe_layers,
                                first_decode=max(0, prefill_steps - first + 1))
    results["compiles_after_warmup"] = eng.runner.compiles_after_warmup
    stats = dev.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        results["peak_gib"] = stats["peak_bytes_in_use"] / 2**30
        print(f"peak device memory {results['peak_gib']:.1f} GiB", flush=True)
    else:  # XLA's VMM allocator (xla_env.py) keeps no stats: the driver's figure after the runs
        from deepinfer_jax.runner.device_memory import device_memory

        mem = device_memory(dev)
        if mem is not None:
            results["in_use_gib"] = mem.in_use / 2**30
            print(f"device memory in use after the runs {results['in_use_gib']:.1f} GiB of "
                  f"{mem.limit / 2**30:.1f} ({mem.source}; weights + KV cache + what XLA keeps)", flush=True)
    print(f"compiles after warm-up: {results['compiles_after_warmup']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
