"""Protocol C-large: the KV cache's host tier (docs/kv-tier.md). Many distinct shared prefixes of 2,048 tokens whose
KV is several times what the device cache holds; requests cycle over them, each prefix plus a fresh suffix, at a
fixed concurrency. TTFT and throughput with the host tier against without it (the prefixes are then recomputed).

    python benchmarks/kv_tier.py                                  # GPU: deepseek-v2-lite shape, random weights
    python benchmarks/kv_tier.py --preset tiny-deepseek-v2 --prefix-len 64 --suffix-len 8 --output-len 4 \\
        --device-prefixes 2 --concurrency 2 --requests 16 --attn-impl reference --moe-impl dense \\
        --dtype float32 --token-buckets 2,16,128 --max-num-batched-tokens 128   # CPU smoke run

First the host link: host-to-device and device-to-host copy bandwidth of a 256 MiB buffer, pageable and pinned
(the tier's pool is pinned where the backend allows: a line says which). Then the timed runs: the same request
stream without and with the tier, TTFT p50 / p90 and mean, output tokens/s, bytes moved. Then correctness, on the
tier's engine with its prefix cache emptied: every prefix is served once cold and once from the host tier (after
other prefixes evicted it from the device), and the greedy tokens of the two are compared (they must match; bf16
chunking differences would show as a match rate below 1, as in the device-cache control printed beside).
The device cache is fixed at --device-prefixes prefixes' pages (--num-pages derived), the prefixes number 4x that.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from deepinfer_jax.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig  # noqa: E402
from deepinfer_jax.types import SamplingParams  # noqa: E402


def link_bandwidth(mib: int = 256, runs: int = 5) -> tuple[float, float]:
    """(host-to-device, device-to-host) GB/s of pageable copies of `mib` MiB, best of `runs`."""
    import jax

    host = np.random.default_rng(0).integers(0, 255, size=mib << 20, dtype=np.uint8)
    dev = jax.devices()[0]
    h2d, d2h = [], []
    for _ in range(runs):
        t = time.perf_counter()
        x = jax.device_put(host, dev)
        x.block_until_ready()
        h2d.append(time.perf_counter() - t)
        t = time.perf_counter()
        np.array(x, copy=True)
        d2h.append(time.perf_counter() - t)
        del x
    return host.nbytes / min(h2d) / 1e9, host.nbytes / min(d2h) / 1e9


def closed_loop(eng, prompts, concurrency: int, output_len: int) -> dict:
    """Serve `prompts` in order, `concurrency` in flight: TTFT per request, the engine steps each request waited for
    its first token and each `step()` call's seconds, tokens, wall time, steps."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    added, first, tokens, calls = {}, {}, {}, []
    nxt, done, steps = 0, 0, 0
    t0 = time.perf_counter()
    while done < len(prompts):
        while nxt < len(prompts) and nxt - done < concurrency:
            rid = f"r{nxt}"
            eng.add_request(rid, prompts[nxt], params)
            added[rid] = (time.perf_counter(), steps)
            nxt += 1
        t = time.perf_counter()
        outs = eng.step()
        calls.append(time.perf_counter() - t)
        steps += 1
        for out in outs:
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = (time.perf_counter(), steps)
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                done += 1
    wall = time.perf_counter() - t0
    ttft = np.array([first[r][0] - added[r][0] for r in added])
    waited = np.array([first[r][1] - added[r][1] for r in added])
    return {"ttft": ttft, "steps_to_first": waited, "first_step": np.array([added[r][1] for r in added]),
            "calls": np.array(calls), "tokens": tokens, "wall": wall, "steps": steps,
            "out_tok_s": sum(map(len, tokens.values())) / wall}


def waited_calls(res: dict, which: np.ndarray) -> str:
    """The mean seconds of each `step()` call the `which` requests waited through for their first token, in order
    (the first plans the request's step and returns the step before it; the next returns the request's step, so it
    lasts about that step's time on the device)."""
    n = int(res["steps_to_first"][which].max())
    cols = [[res["calls"][s + k] * 1e3 for s, w in zip(res["first_step"][which], res["steps_to_first"][which])
             if k < w] for k in range(n)]
    return ", ".join(f"call {k + 1} {np.mean(c):.1f} ms" for k, c in enumerate(cols))


def agreement(cold: list, warm: list) -> str:
    """How far greedy outputs after a cache hit agree with the cold run's: all tokens, the first token, and the
    mean length of the common start."""
    same = np.mean([a == b for a, b in zip(cold, warm)])
    first = np.mean([a[:1] == b[:1] for a, b in zip(cold, warm)])
    common = np.mean([next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                      for a, b in zip(cold, warm)])
    return f"all equal {same:.0%}, first token {first:.0%}, common start {common:.1f} tokens of {len(cold)} requests"


def tier_copy_rate(eng, pages: int, runs: int = 5, stride: int = 1) -> float:
    """GB/s of the tier's own host-to-device path: `pages` host blocks (distinct, `stride` apart: 1 as a prefix's
    pages saved together lie, copied RUN_PAGES at a time; 2 a page a copy) loaded through the runner's
    KVTransfer.apply (fetch programs, then the scatter into the cache) onto the null page, which no sequence reads;
    best of `runs`, timed until the cache is ready. Run after the timed passes and the check (it writes the null
    page only)."""
    from deepinfer_jax.models.cache import NULL_PAGE
    from deepinfer_jax.runner.kv_transfer import _Copies

    runner = eng.runner
    tr = runner.kv_transfer
    pages = min(pages, tr.storage.shape[0] // stride)
    copies = _Copies(saves=[], loads=[(stride * i, NULL_PAGE) for i in range(pages)])
    best = float("inf")
    for _ in range(runs + 1):  # the first run compiles nothing (warm) but pays first-use costs
        t = time.perf_counter()
        runner.kv_cache = tr.apply(runner.kv_cache, copies)
        runner.kv_cache.block_until_ready()
        best = min(best, time.perf_counter() - t)
    return pages * tr.page_bytes / best / 1e9


def check_tier(eng, check: list, args) -> None:
    """Correctness (module doc) on the timed tier engine, its prefix cache emptied: each prefix cold, then (the others
    having evicted it) from the host tier; beside it, the same comparison for hits in the device cache (each prompt
    twice in a row, one at a time), which tells bf16's differences between a whole prefill and a prefill of the
    suffix alone from a defect of the tier."""
    if not eng.scheduler.kv_cache_manager.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset (pages still held)")
    pairs = [p for p in check[:args.concurrency] for _ in range(2)]
    res = closed_loop(eng, pairs, 1, args.output_len)
    device_hit = agreement([res["tokens"][f"r{2 * i}"] for i in range(len(pairs) // 2)],
                           [res["tokens"][f"r{2 * i + 1}"] for i in range(len(pairs) // 2)])
    hits0 = eng.stats().host_tier_hits
    res = closed_loop(eng, check + check, args.concurrency, args.output_len)  # the same prompts again, evicted
    n, st = len(check), eng.stats()
    cold, warm = ([res["tokens"][f"r{i}"] for i in range(a, a + n)] for a in (0, n))
    print(f"correctness: host-tier hits {st.host_tier_hits - hits0} tokens; greedy tokens after a hit against the "
          f"cold run's, host tier: {agreement(cold, warm)}; device cache (the control): {device_hit}", flush=True)
    if st.host_tier_hits == hits0:
        print("WARNING: the host tier served no hit in the correctness pass", flush=True)


def main(argv=None) -> int:
    from deepinfer_jax.server.args import ArgParser, positive_int, power_of_two

    ap = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v2-lite", help="a model of configs/models")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--attn-impl", default="pallas")
    ap.add_argument("--moe-impl", default="pallas")
    ap.add_argument("--page-size", type=power_of_two, default=64)
    ap.add_argument("--prefix-len", type=positive_int, default=2048)
    ap.add_argument("--suffix-len", type=positive_int, default=64)
    ap.add_argument("--output-len", type=positive_int, default=16)
    ap.add_argument("--device-prefixes", type=positive_int, default=16,
                    help="prefixes the device cache holds (it gets that many prefixes' pages plus room for the "
                         "requests in flight); the prefixes number 4x this")
    ap.add_argument("--concurrency", type=positive_int, default=8)
    ap.add_argument("--requests", type=positive_int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    from offline import _csv

    ap.add_argument("--token-buckets", type=_csv("positive integers", positive_int), default=(8, 128, 512, 4096, 8192),
                    help="the step sizes the engines compile (comma-separated), those of the default power-of-two "
                         "buckets this workload reaches: decodes (--concurrency), tier hits' suffixes with decodes, "
                         "cold prefixes (one 2,112-token prompt pads to 4,096 as with the default buckets) and full "
                         "steps; every default bucket would take minutes of warm-up on each engine")
    args = ap.parse_args(argv)
    if args.device_prefixes < args.concurrency:
        ap.error(f"--device-prefixes ({args.device_prefixes}) must be at least --concurrency ({args.concurrency})")
    if args.requests < 8 * args.device_prefixes:
        ap.error(f"--requests ({args.requests}) must be at least twice the prefixes ({4 * args.device_prefixes}, 4x "
                 f"--device-prefixes): requests cycle over the prefixes, and only a prefix's returns can hit a tier")

    buckets = tuple(sorted(set(args.token_buckets)))
    from deepinfer_jax.xla_env import use_host_memory

    use_host_memory(None, 1.0)  # pinned host memory: no VMM allocator, set before JAX starts (xla_env.py)
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.models.cache import kv_cache_bytes_per_page
    from deepinfer_jax.runner.compile_cache import enable_compilation_cache
    from deepinfer_jax.weights.random_init import random_params

    enable_compilation_cache("default")
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}", flush=True)
    h2d, d2h = link_bandwidth()
    print(f"host link (pageable, 256 MiB): host-to-device {h2d:.1f} GB/s, device-to-host {d2h:.1f} GB/s", flush=True)
    from offload import pinned_link_bandwidth

    h2d, d2h = pinned_link_bandwidth(256)
    print(f"host link (pinned, 256 MiB): host-to-device {h2d:.1f} GB/s, device-to-host {d2h:.1f} GB/s", flush=True)

    cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(HERE), "configs", "models", f"{args.preset}.json"))
    params = random_params(cfg, jnp.dtype(args.dtype), seed=0)
    ps = args.page_size
    req_len = args.prefix_len + args.suffix_len + args.output_len
    req_pages = -(-req_len // ps)
    # the cached prefixes' pages, plus each request's own pages past its prefix
    own_pages = -(-(req_len - args.prefix_len // ps * ps) // ps)
    num_pages = args.device_prefixes * (args.prefix_len // ps) + args.concurrency * own_pages + 1
    num_prefixes = 4 * args.device_prefixes
    page_bytes = kv_cache_bytes_per_page(cfg, ps, args.dtype)
    tier_gib = 1.25 * num_prefixes * (req_pages + 1) * page_bytes / 2**30
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(2, cfg.vocab_size, args.prefix_len).tolist() for _ in range(num_prefixes)]

    def stream(n, seed):
        r = np.random.default_rng(seed)
        return [prefixes[i % num_prefixes] + r.integers(2, cfg.vocab_size, args.suffix_len).tolist()
                for i in range(n)]

    def engine(gib):
        return LLMEngine(cfg, params, None, num_pages=num_pages, progress=False,
                         scheduler_config=SchedulerConfig(max_num_seqs=args.concurrency,
                                                          max_num_batched_tokens=args.max_num_batched_tokens,
                                                          max_model_len=req_len),
                         cache_config=CacheConfig(page_size=ps, kv_offloading_size=gib),
                         runner_config=RunnerConfig(dtype=args.dtype, attn_impl=args.attn_impl, moe_impl=args.moe_impl,
                                                    token_buckets=buckets))

    prefix_gib = num_prefixes * (args.prefix_len // ps) * page_bytes / 2**30
    print(f"{num_prefixes} prefixes of {args.prefix_len} tokens ({prefix_gib:.2f} GiB of KV), device cache {num_pages} "
          f"pages ({num_pages * page_bytes / 2**30:.2f} GiB), host tier {tier_gib:.2f} GiB", flush=True)

    rows = []
    for name, gib in (("recompute (no tier)", 0.0), ("host tier", tier_gib)):
        t = time.perf_counter()
        eng = engine(gib)
        print(f"{name}: engine started in {time.perf_counter() - t:.1f} s", flush=True)
        closed_loop(eng, stream(args.concurrency, 2), args.concurrency, args.output_len)  # warm the programs
        res = closed_loop(eng, stream(args.requests, 3), args.concurrency, args.output_len)
        mem = eng.memory_report()
        moved = (mem.get("kv_offload_to_host", 0), mem.get("kv_offload_to_device", 0))
        rows.append((name, res, moved))
        print(f"{name}: {time.perf_counter() - t:.1f} s (engine start, warm-up, {args.requests} requests)", flush=True)
        if gib:
            print(f"host tier pool: {'pinned' if eng.runner.kv_transfer.pinned else 'pageable'} host memory",
                  flush=True)
            check_tier(eng, stream(num_prefixes, 1), args)
            n = 2 * (args.prefix_len // ps)
            rate, scattered = tier_copy_rate(eng, n), tier_copy_rate(eng, n, stride=2)
            print(f"the tier's host-to-device copies: {rate:.1f} GB/s, {rate / h2d:.0%} of the pinned link "
                  f"({h2d:.1f} GB/s; target >= 80%), {n} pages a batch, {eng.runner.kv_transfer.run} consecutive "
                  f"host blocks a copy; scattered blocks, a page a copy: {scattered:.1f} GB/s ({scattered / h2d:.0%})",
                  flush=True)
        del eng
    # Request i uses prefix i % num_prefixes: its first visit can hit no cache in either engine (bar the warm-up's
    # prefixes); from i = num_prefixes on, each request returns to a prefix that others have since evicted from the
    # device cache: the tier's case.
    back = np.arange(args.requests) >= num_prefixes
    print(f"\n{'':22}{'TTFT p50 ms':>12}{'p90 ms':>10}{'mean ms':>10}{'returning: p50':>16}{'mean':>8}"
          f"{'first visits: mean':>20}{'out tok/s':>11}{'to host GB':>12}{'to dev GB':>11}")
    for name, res, moved in rows:
        t = res["ttft"] * 1e3
        print(f"{name:22}{np.percentile(t, 50):12.1f}{np.percentile(t, 90):10.1f}{t.mean():10.1f}"
              f"{np.percentile(t[back], 50):16.1f}{t[back].mean():8.1f}{t[~back].mean():20.1f}"
              f"{res['out_tok_s']:11.1f}{moved[0] / 1e9:12.2f}{moved[1] / 1e9:11.2f}")
    for name, res, _ in rows:  # TTFT = steps waited x their time: which of the two the tier shortens
        print(f"{name}: the returning requests waited {res['steps_to_first'][back].mean():.1f} engine steps for their "
              f"first token ({waited_calls(res, back)}); a step took {res['wall'] / res['steps'] * 1e3:.1f} ms on "
              f"average over the run")
    base, tier = (r[1]["ttft"][back].mean() for r in rows[:2])
    print(f"\nmean TTFT of the returning requests ({back.sum()}), recompute / host tier: {base / tier:.2f}x (target "
          f">= 3x at concurrency {args.concurrency}); over all {args.requests}: "
          f"{rows[0][1]['ttft'].mean() / rows[1][1]['ttft'].mean():.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
