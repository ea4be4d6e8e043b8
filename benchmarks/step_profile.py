"""Where a decode step's time goes: the device time of one isolated step (same inputs, repeated) next
to the host time of preparing it, for implementation variants. The V2-Lite shape, random weights.

    python benchmarks/step_profile.py --batch 32 --context 640 [--unroll auto|on|off] [--moe-impl ragged]
Run it under different XLA_FLAGS (e.g. command buffers for while loops) to compare lowering choices.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.runner_flags import add_variant_flags, variant_kwargs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--attn-impl", default="pallas")
    ap.add_argument("--moe-impl", default="pallas")
    ap.add_argument("--unroll", choices=["auto", "on", "off"], default="auto",
                    help="layers unrolled: auto = the engine's default (RunnerConfig.unroll_max_tokens); off: "
                         "lax.scan unless --prefill-layers says otherwise")
    ap.add_argument("--prefill", type=int, default=0,
                    help="time a prefill step instead: each of --batch seqs brings this many new tokens after "
                         "--context cached ones")
    ap.add_argument("--dump-hlo", default="", help="dump the optimized HLO of the step into this folder")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--data-parallel-size", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--layers", type=int, default=0, help="cut the model to this many layers (quick lowering experiments)")
    ap.add_argument("--num-pages", type=int, default=0,
                    help="KV cache pages (default: just enough for the batch); e.g. 48000 to see the effect of "
                         "an engine-sized cache (64-bit offsets, XLA's scheduler memory limit)")
    add_variant_flags(ap)
    ap.add_argument("--attn-splits", type=int, default=0,
                    help="override the decode attention's context splits (kernels/mla_decode.auto_splits)")
    ap.add_argument("--attn-pages-per-step", type=int, default=0,
                    help="pages the decode attention walks per loop step (kernels/mla_decode.PAGES_PER_STEP)")
    ap.add_argument("--attn-block-keys", type=int, default=0,
                    help="keys the decode attention reads per loop step, a divisor of the page (mla_decode.BLOCK_KEYS)")
    ap.add_argument("--attn-kernel", default="",
                    help="num_warps=W,num_stages=S: the decode attention kernel's compiler parameters")
    ap.add_argument("--output-kernel", default="",
                    help="block_v=V,block_r=R,num_warps=W,num_stages=S: the output kernel's (merge and W_UV) tiles")
    ap.add_argument("--route-experts", default="",
                    help="num_warps=W,shared_down_late=0|1: the route and experts launch (decode_moe_launch)")
    ap.add_argument("--argmax-chunk", type=int, default=0,
                    help="the sampler's categorical draw: ids per argmax chunk (sampling/draw.ARGMAX_CHUNK; "
                         "e.g. 1000000 for one argmax over the whole vocabulary)")
    ap.add_argument("--moe-decode-tiles", default="",
                    help="bm,bn,bk,warps,stages for the MoE kernels below 2,048 token copies (moe_gmm.tile_config)")
    ap.add_argument("--decode-matmul-plan", default="",
                    help="K,N=bn,bk,split[,warps,stages]: kernels/decode_matmul.py's launch for a [K, N] weight "
                         "(its `plan`), e.g. 2048,2048=16,256,1 for o_proj without a split K")
    ap.add_argument("--absorb-full-width-max-tokens", type=int, default=-1,
                    help="override models/mla.py's ABSORB_FULL_WIDTH_MAX_TOKENS (0: always slice W_UK)")
    ap.add_argument("--label", default="")
    ap.add_argument("--trace", default="", help="write a perfetto trace of 3 steps here and print the top kernels")
    args = ap.parse_args(argv)
    if args.dump_hlo:  # before JAX starts: XLA reads its flags once
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump_hlo}"
                                   " --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*").strip()

    import jax
    import jax.numpy as jnp

    from deepinfer_jax.config import ModelConfig, RunnerConfig
    from deepinfer_jax.runner.inputs import Shapes
    from deepinfer_jax.runner.model_runner import ModelRunner
    from deepinfer_jax.scheduler.scheduler import ScheduledSeq
    from deepinfer_jax.types import Request, SamplingParams
    from deepinfer_jax.weights.random_init import random_params
    from deepinfer_jax.kernels import mla_decode, mla_output, route_experts
    from deepinfer_jax.sampling import draw

    if args.attn_splits:
        mla_decode.auto_splits = lambda num_tokens: args.attn_splits
    if args.attn_pages_per_step:
        mla_decode.PAGES_PER_STEP = args.attn_pages_per_step
    if args.argmax_chunk:
        draw.ARGMAX_CHUNK = args.argmax_chunk
    if args.attn_block_keys:
        mla_decode.BLOCK_KEYS = args.attn_block_keys
    for module, name, spec in ((mla_decode, "paged_mla_attention_splits", args.attn_kernel),
                               (mla_output, "merge_value_projection", args.output_kernel),
                               (route_experts, "route_experts", args.route_experts)):
        if spec:  # k=v,..: keyword arguments of the kernel's wrapper
            kw = {k: int(v) for k, v in (item.split("=") for item in spec.split(","))}
            setattr(module, name, functools.partial(getattr(module, name), **kw))
    if args.absorb_full_width_max_tokens >= 0:
        from deepinfer_jax.models import mla

        mla.ABSORB_FULL_WIDTH_MAX_TOKENS = args.absorb_full_width_max_tokens
    if args.decode_matmul_plan:
        from deepinfer_jax.kernels import decode_matmul

        kn, tiles = args.decode_matmul_plan.split("=")
        kn, base_plan = tuple(int(v) for v in kn.split(",")), decode_matmul.plan
        tiles = decode_matmul.Launch(*(int(v) for v in tiles.split(",")))
        decode_matmul.plan = lambda K, N: tiles if (K, N) == kn else base_plan(K, N)
    if args.moe_decode_tiles:
        from deepinfer_jax.kernels import moe_gmm, moe_route

        tiles, base = tuple(int(v) for v in args.moe_decode_tiles.split(",")), moe_gmm.tile_config
        moe_gmm.tile_config = moe_route.tile_config = lambda n: tiles if n < 2048 else base(n)
    cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(HERE), "configs", "models", f"{args.preset}.json"))
    if args.layers:
        import dataclasses

        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers)
    params = random_params(cfg, jnp.bfloat16)
    from deepinfer_jax.sharding import ParallelConfig, build_sharding

    parallel = ParallelConfig(args.tensor_parallel_size, args.data_parallel_size, args.enable_expert_parallel)
    sharding = None if parallel.is_single_device else build_sharding(cfg, parallel)
    if sharding is not None:
        params = jax.device_put(params, sharding.param_shardings(cfg))
    ps, dp = 64, args.data_parallel_size
    B, new = args.batch, max(1, args.prefill)
    Br = B // dp  # sequences per data-parallel rank
    max_len = max(1024, args.context + new)
    pages_per = -(-max_len // ps)
    num_pages = max(args.num_pages, Br * pages_per + 1)  # per rank
    T = 1 << (Br * new - 1).bit_length()  # the token bucket (per rank)
    shapes = Shapes((T,), Br, pages_per, ps, max_len)
    variants = variant_kwargs(args)
    if args.unroll == "off" and variants["prefill_layers"] is None:
        variants["prefill_layers"] = "scan"
    rc = RunnerConfig(dtype="bfloat16", attn_impl=args.attn_impl, moe_impl=args.moe_impl,
                      unroll_max_tokens={"auto": None, "on": 1 << 30, "off": 0}[args.unroll], warmup_full_variant=False,
                      **variants)
    t0 = time.time()
    runner = ModelRunner(cfg, params, rc, shapes, num_pages, sharding=sharding)
    # Random cache contents, filled in place (an engine-sized cache leaves no room for a second copy).
    page = jax.random.normal(jax.random.key(3), runner.kv_cache.shape[-2:], runner.kv_cache.dtype)
    runner.kv_cache = jax.jit(lambda c, p: c + p, donate_argnums=0)(runner.kv_cache, page)
    rng = np.random.default_rng(0)
    seqs, reqs, seeds = [], {}, {}
    for b in range(B):
        rid = f"r{b}"
        j = b // dp  # the seq's index on its rank (rank b % dp); page ids are rank-local
        pages = list(range(1 + j * pages_per, 1 + (j + 1) * pages_per))
        ids = [int(i) for i in rng.integers(100, 90000, new)]
        seqs.append(ScheduledSeq(rid, ids, args.context, pages, True, 1))
        reqs[rid] = Request(rid, [1] * (args.context + new), SamplingParams(temperature=0.0, max_tokens=8))
        seeds[rid] = b
    ranks = [b % dp for b in range(B)] if dp > 1 else None
    host = runner.prepare(seqs, reqs, seeds, ranks)
    jax.block_until_ready(runner.run(host))
    compile_s = time.time() - t0
    for _ in range(3):
        jax.block_until_ready(runner.run(host))
    ts = []
    for _ in range(20):
        t = time.perf_counter()
        jax.block_until_ready(runner.run(host))
        ts.append(time.perf_counter() - t)
    # Steps queued back to back (the engine's steady state: the host enqueues while the device runs):
    # per-step time = max(host enqueue, device time). Once through the jitted function's C++ fast
    # path, once through the Compiled executable the engine's warm-up installs.
    def pipelined(n=30):
        enq = []
        jax.block_until_ready(runner.run(host))
        t = time.perf_counter()
        for _ in range(n):
            t1 = time.perf_counter()
            runner.run(host)
            enq.append(time.perf_counter() - t1)
        jax.block_until_ready(runner.kv_cache)
        return (time.perf_counter() - t) / n, float(np.median(enq))

    # The engine's pattern: step N's sampled ids are read (np.asarray) after step N+1 is queued, so two
    # steps' outputs are alive at once; `early` starts their device-to-host copy right after dispatch.
    def engine_like(n=30, early=False):
        jax.block_until_ready(runner.run(host))
        prev, t = None, time.perf_counter()
        for _ in range(n):
            out = runner.run(host)
            if early:
                out.copy_to_host_async()
            if prev is not None:
                prev.to_host()
            prev = out
        prev.to_host()
        return (time.perf_counter() - t) / n

    engine_late, engine_early = engine_like(), engine_like(early=True)
    pipe_jit = pipelined()
    runner.warmup(progress=False)  # installs the Compiled executables, as the engine does
    pipe_exe = pipelined()
    hs = []
    for _ in range(20):
        t = time.perf_counter()
        runner.prepare(seqs, reqs, seeds, ranks)
        hs.append(time.perf_counter() - t)
    dev = float(np.median(ts))
    if args.trace:
        top_kernels(runner, host, args.trace, sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers))))
    layout = f"TP={args.tensor_parallel_size} DP={dp} EP={args.enable_expert_parallel} "
    kind = layout + (f"prefill {B}x{new} after {args.context}" if args.prefill else f"decode batch {B} at {args.context}")
    kind += f", {num_pages} pages"
    print(f"{args.label or 'variant'}: {kind} attn={args.attn_impl} moe={args.moe_impl}"
          f"{'+shared' if args.fuse_shared_experts else ''}{'+routing' if args.fuse_moe_routing else ''} "
          f"prefill_attention={args.prefill_attention} attn_pages_per_step={args.attn_pages_per_step or 1} "
          f"unroll={args.unroll} "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: device step {dev*1e3:.2f} ms "
          f"({B * new / dev:,.0f} tok/s), host prepare {np.median(hs)*1e3:.2f} ms, compile+first {compile_s:.1f}s",
          flush=True)
    for name, (per, enq) in (("jit", pipe_jit), ("compiled", pipe_exe)):
        print(f"  pipelined via {name}: {per*1e3:.2f} ms/step, host enqueue {enq*1e3:.2f} ms/step", flush=True)
    print(f"  engine-like (ids read one step later): {engine_late*1e3:.2f} ms/step; with the copy to host started "
          f"at dispatch: {engine_early*1e3:.2f} ms/step", flush=True)
    return 0


def top_kernels(runner, host, trace_dir: str, moe_layers: int, steps: int = 3) -> None:
    """Trace `steps` steps and print GPU time per kernel name, one layer in launch order and the idle gaps."""
    import jax

    from benchmarks.trace_tools import print_report

    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(steps):
            jax.block_until_ready(runner.run(host))
    print_report(trace_dir, moe_layers, steps)


if __name__ == "__main__":
    sys.exit(main())
