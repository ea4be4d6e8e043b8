"""Long contexts with the KV cache's host tier (docs/kv-tier.md): tokens/s, a returning request's TTFT, bytes moved,
and the device memory the tier saves, at 32K and 128K-token contexts on the DeepSeek-V2-Lite shape.

    python benchmarks/kv_tier_long.py                        # GPU (one H100 80 GB): contexts 32,768 and 131,072
    python benchmarks/kv_tier_long.py --contexts 131072      # one context
    python benchmarks/kv_tier_long.py --smoke                # CPU: the tiny model, contexts 256 and 512

The workload, for each context C: N sequences, each a distinct random prompt of C - turn - 2 out tokens generating
`--output-len` (out) tokens (round 1, all N at once), whose contexts together exceed a deliberately small device
pool; then sequence 0, the oldest, returns (round 2, alone): its round-1 prompt and output plus `--turn-len` new
tokens, generating out more: its context ends at C. Three engines (LLMEngine, random weights) serve the same workload:
- all-resident: no tier, a pool that holds every sequence's KV at once: 1 (the null page) + for sequence 0
  cdiv(C, page) + for each other sequence cdiv(C - turn - out, page) pages (their longest contexts). The run checks it
  preempted nothing and that the returning request found all its full pages on the device.
- host-tier: the small pool, `--pool-contexts` times the longest context's pages (+ the null page), and a host tier
  holding 1.25x every sequence's pages. A running request that cannot get pages is preempted (at 128K the second
  sequence, admitted with a step's leftover budget; at 32K, where a sequence is a fifth of the pool, the last ones
  wait for pages instead); its pages stay cached, those later evicted from the device are copied to the host, and
  it resumes from them. The returning request's pages come back from the host. The run must hit the host tier, or
  the script stops; a note says when no request of round 1 came back from it.
- recompute: the small pool without a tier: what left the device is recomputed.
N = max(2, ceil(--oversubscribe x small pool tokens / C)). One engine of each kind serves every context
(max_model_len: the longest), so the small pool is the same for all contexts; each context starts with the prefix
cache of both tiers emptied. The prefills dominate the time (attention's work grows with the square of the context:
at 128K every engine prefills two whole contexts, recompute a third for the returning one); `--contexts` and
`--kinds` (e.g. host-tier,recompute: the tier's tokens are then checked against recompute's) split the run.

Correctness first: every request's greedy tokens (all runs ask for the five most likely tokens' log-probs: the
sampler's full variant) with the tier, and with recompute, are compared with the all-resident run's: equal, or parting
only at a near tie (each run's token among the other's five most likely, as bf16 rounds differently where a preempted
request's prefill is chunked differently); anything else prints both runs' log-probs at the parting and stops the
script before the table. Then, per context, the table:
- tok/s: round 1's prompt + output tokens over its wall time; decode tok/s: the sequences stepped in the steps
  that computed only decodes, over those steps' time (a step's time: the `step` call after it, which waits for it);
- computed: round 1's step input tokens (prompts, each output fed back, and what preemption and eviction made the
  engine compute again: all-resident computes each once);
- TTFT of the returning request, and where its context came from (device / host hits, computed);
- bytes copied to and from the host tier (both rounds); the device memory saved: all-resident pool less the small
  pool, in pages and GiB.
Before the timed runs each engine serves a short warm-up (its start compiled the tier's copy programs, every size
class: runner/kv_transfer.py `KVTransfer.warm`). The three engines share one process and so its XLA flags (the
tier's pinned pool needs XLA's default allocator, docs/kv-tier.md).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from kv_tier import link_bandwidth  # noqa: E402

from deepinfer_jax.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig  # noqa: E402
from deepinfer_jax.scheduler.kv_cache_manager import cdiv  # noqa: E402
from deepinfer_jax.types import RequestOutputKind, SamplingParams  # noqa: E402

KINDS = ("all-resident", "host-tier", "recompute")
LOGPROBS = 5  # each step's most likely tokens asked for: a parting among them is a near tie
T0 = time.perf_counter()


def stamp(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def counters(eng) -> dict:
    st, mem = eng.stats(), eng.memory_report()
    return dict(preempt=st.num_preemptions, queries=st.prefix_cache_queries, hits=st.prefix_cache_hits,
                host_hits=st.host_tier_hits, saved=st.host_blocks_saved, loaded=st.host_blocks_loaded,
                to_host=mem.get("kv_offload_to_host", 0), to_dev=mem.get("kv_offload_to_device", 0))


def drive(eng, prompts: list, params: SamplingParams, tag: str) -> dict:
    """All `prompts` added at once and served to the end: tokens, top-2 logprobs, TTFT and cached tokens per request;
    wall time; the decode-only steps' time and sequences; the steps' input tokens; counter deltas."""
    from deepinfer_jax.runner.compile_cache import CompileCounter

    sch, before, compiles = eng.scheduler, counters(eng), CompileCounter.count()
    rids = [f"{tag}{i}" for i in range(len(prompts))]
    toks, lps, ttft, cached = {r: [] for r in rids}, {r: [] for r in rids}, {}, {}
    t0 = time.perf_counter()
    for rid, p in zip(rids, prompts):
        eng.add_request(rid, p, params)
    dec_s, dec_tokens, computed, runner, prev = 0.0, 0, 0, eng.runner, 0
    while eng.has_unfinished_requests():
        # `step` queues this step and waits for the previous one: its time is the previous step's (`prev`: the
        # sequences it decoded when it computed only decodes, else 0)
        decode_only = not sch.waiting and sch.running and all(r.num_tokens - r.num_computed_tokens == 1
                                                              for r in sch.running)
        n, t, steps = len(sch.running), time.perf_counter(), runner.steps_by_variant.total()
        outs = eng.step()
        now = time.perf_counter()
        if prev:
            dec_s, dec_tokens = dec_s + now - t, dec_tokens + prev
        dispatched = runner.steps_by_variant.total() > steps
        computed += runner.last_num_tokens if dispatched else 0  # the step's input tokens
        prev = n if dispatched and decode_only else 0
        for out in outs:
            o = out.outputs[0]
            if o.token_ids and out.request_id not in ttft:
                ttft[out.request_id] = now - t0
            toks[out.request_id] += o.token_ids
            lps[out.request_id] += o.logprobs or []
            cached[out.request_id] = out.num_cached_tokens
    wall = time.perf_counter() - t0
    after = counters(eng)
    return dict(tokens=[toks[r] for r in rids], logprobs=[lps[r] for r in rids], ttft=[ttft[r] for r in rids],
                cached=[cached[r] for r in rids], wall=wall, dec_s=dec_s, dec_tokens=dec_tokens, computed=computed,
                compiles=CompileCounter.count() - compiles, **{k: after[k] - before[k] for k in after})


def most_likely(lps: dict) -> str:
    """A step's asked-for log-probs, most likely first: 'token: logprob, ...'."""
    return ", ".join(f"{t}: {x.logprob:.3f}" for t, x in sorted(lps.items(), key=lambda kv: -kv[1].logprob))


def compare(ref: dict, got: dict) -> tuple[int, list, list]:
    """(requests with identical tokens, [(request, position, gap)] partings at a near tie, [(request, position, how)]
    partings that are not: `how` gives each run's most likely log-probs there, to tell noise from a fault)."""
    same, near, bad = 0, [], []
    for j, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None and len(a) == len(b):
            same += 1
            continue
        if i is None:
            bad.append((j, min(len(a), len(b)), "lengths differ"))
            continue
        la, lb = ref["logprobs"][j][i], got["logprobs"][j][i]
        if b[i] in la and a[i] in lb:
            near.append((j, i, la[a[i]].logprob - la[b[i]].logprob))
        else:
            bad.append((j, i, f"reference {{{most_likely(la)}}}, this run {{{most_likely(lb)}}}"))
    return same, near, bad


def warm(eng, vocab: int, ps: int, params: SamplingParams) -> float:
    """A short workload (prefill, prefill with context, decode, the sampler's logprobs; the engine compiled the tier's
    copy programs at its warm-up). The prefix cache of both tiers is emptied after."""
    t = time.perf_counter()
    rng = np.random.default_rng(7)
    p = rng.integers(2, vocab, 3 * ps).tolist()
    drive(eng, [p, rng.integers(2, vocab, 2 * ps + 1).tolist()], params, "w")
    drive(eng, [p + rng.integers(2, vocab, ps).tolist()], params, "w2")
    if not eng.scheduler.kv_cache_manager.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset (pages still held)")
    return time.perf_counter() - t


def run_context(eng, kind: str, w: dict, params: SamplingParams) -> dict:
    """Round 1 (all sequences at once), then sequence 0 returns with its output and a new turn."""
    if not eng.scheduler.kv_cache_manager.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset (pages still held)")
    r1 = drive(eng, w["prompts"], params, f"{w['context']}-r1-")
    ret = w["prompts"][0] + r1["tokens"][0] + w["turn"]
    r2 = drive(eng, [ret], params, f"{w['context']}-r2-")
    stamp(f"{kind}, context {w['context']:,}: round 1 {r1['wall']:.1f} s ({r1['preempt']} preemptions), "
          f"returning TTFT {r2['ttft'][0] * 1e3:.0f} ms ({r2['cached'][0]:,} of {len(ret):,} tokens cached, "
          f"{r2['host_hits']:,} from the host)")
    return dict(r1=r1, r2=r2, ret_len=len(ret))


def check(w: dict, res: dict, ps: int) -> None:
    """Correctness (module doc): stops the script on a failure."""
    ctx, out = w["context"], len(w["prompts"][0]) + w["output_len"]
    allres, tier = res.get("all-resident"), res.get("host-tier")
    if allres and (allres["r1"]["preempt"] or allres["r2"]["cached"][0] != (out - 1) // ps * ps):
        sys.exit(f"check FAILED (context {ctx}): the all-resident pool preempted or recomputed (a sizing bug)")
    if tier and not tier["r1"]["host_hits"] + tier["r2"]["host_hits"]:
        sys.exit(f"check FAILED (context {ctx}): the tier run hit the host tier for no token: the workload does not "
                 "exercise it (raise --oversubscribe or lower --pool-contexts)")
    if tier and "swap noted" not in w and not tier["r1"]["host_hits"]:
        w["swap noted"] = True
        print(f"note (context {ctx:,}): no request of round 1 came back from the host tier ({tier['r1']['preempt']} "
              "preemptions; a preempted request resumed from its pages still on the device, or sequences waited for "
              "pages instead); the tier's hits are the returning request's")
    ref = "all-resident" if allres else "recompute"  # without an all-resident run (--kinds): the tier against recompute
    if ref not in res:
        return
    for kind in [k for k in KINDS if k in res and k != ref and k not in w.setdefault("checked", [])]:
        w["checked"].append(kind)
        failed = []
        for rnd in ("r1", "r2"):
            same, near, bad = compare(res[ref][rnd], res[kind][rnd])
            n = len(res[ref][rnd]["tokens"])
            parts = "; ".join(f"request {j} parts at token {i} (gap {g:.4f})" for j, i, g in near)
            print(f"check (context {ctx:,}, {'round 1' if rnd == 'r1' else 'returning'}): {kind} against "
                  f"{ref}: {same}/{n} requests' greedy tokens identical"
                  + (f", near ties: {parts}" if near else "")
                  + "".join(f"\n  NOT a near tie: request {j} parts at token {i}: {how}" for j, i, how in bad),
                  flush=True)
            failed += bad
            if rnd == "r1" and (near or bad) and 0 in [j for j, *_ in near + bad]:
                print("  (sequence 0 parted in round 1: the returning prompts differ, round 2 not compared)")
                break
        if failed:
            sys.exit(f"check FAILED (context {ctx}): {kind}'s tokens are not {ref}'s; no timings")


def table(w: dict, res: dict, pages: dict, page_bytes: int) -> None:
    ctx, n = w["context"], len(w["prompts"])
    print(f"\ncontext {ctx:,}: {n} sequences x ({len(w['prompts'][0]):,} in + {w['output_len']} out) at once, then "
          f"sequence 0 returns with {len(w['turn'])} new tokens ({res["host-tier"]['ret_len']:,} in + "
          f"{w['output_len']} out)")
    print(f"{'':14}{'':>18}{'round 1':-^45}{'returning request':-^38}{'both rounds':>21}")
    print(f"{'':14}{'pool pages':>11}{'GiB':>7}{'preempt':>8}{'host hit':>9}{'tok/s':>9}{'decode':>8}{'computed':>11}"
          f"{'TTFT ms':>11}{'dev hit':>9}{'host hit':>9}{'computed':>9}{'to host GB':>11}{'to dev GB':>10}")
    for kind in [k for k in KINDS if k in res]:
        r1, r2, p = res[kind]["r1"], res[kind]["r2"], pages[kind]
        tokens = sum(map(len, w["prompts"])) + sum(map(len, r1["tokens"]))
        dec = r1["dec_tokens"] / r1["dec_s"] if r1["dec_s"] else float("nan")
        ret, cached, host = res[kind]["ret_len"], r2["cached"][0], r2["host_hits"]
        print(f"{kind:14}{p:11,}{p * page_bytes / 2**30:7.2f}{r1['preempt']:8}{r1['host_hits']:9,}"
              f"{tokens / r1['wall']:9.0f}{dec:8.1f}"
              f"{r1['computed']:11,}{r2['ttft'][0] * 1e3:11.0f}{cached - host:9,}{host:9,}"
              f"{ret - cached:9,}{(r1['to_host'] + r2['to_host']) / 1e9:11.2f}"
              f"{(r1['to_dev'] + r2['to_dev']) / 1e9:10.2f}")
        if r1["compiles"] + r2["compiles"]:
            print(f"  WARNING: {r1['compiles'] + r2['compiles']} compilations inside the {kind} run's timings")
    need, small = w["need_pages"], pages["host-tier"]
    print(f"device memory saved: all-resident {need:,} pages ({need * page_bytes / 2**30:.2f} GiB) - host tier's pool "
          f"{small:,} ({small * page_bytes / 2**30:.2f} GiB) = {(need - small) * page_bytes / 2**30:.2f} GiB "
          f"({1 - small / need:.0%} of the all-resident pool)" + (
              "" if "recompute" not in res else "; returning TTFT, recompute / host tier: "
              f"{res['recompute']['r2']['ttft'][0] / res["host-tier"]['r2']['ttft'][0]:.1f}x"))


def run(argv=None) -> dict:
    """The benchmark (module doc); returns {context: {kind: its rounds}} after printing the tables."""
    from deepinfer_jax.server.args import ArgParser, positive_float, positive_int, power_of_two

    ap = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: the tiny model at small sizes (the defaults of the options below; those given are kept)")
    ap.add_argument("--preset", default="deepseek-v2-lite", help="a model of configs/models")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--attn-impl", default="pallas")
    ap.add_argument("--moe-impl", default="pallas")
    ap.add_argument("--page-size", type=power_of_two, default=64)
    ap.add_argument("--contexts", default="32768,131072", help="comma-separated context lengths (tokens)")
    ap.add_argument("--output-len", type=positive_int, default=512)
    ap.add_argument("--turn-len", type=positive_int, default=256, help="new tokens of the returning request")
    ap.add_argument("--pool-contexts", type=positive_float, default=1.25,
                    help="the small device pool, in contexts of the longest length (at least 1)")
    ap.add_argument("--oversubscribe", type=positive_float, default=1.2,
                    help="the sequences' contexts together, over the small pool's tokens (at least this)")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    ap.add_argument("--token-buckets", default="2,512,8192",
                    help="the step sizes the engines compile (comma-separated): decodes (at most two sequences: a "
                         "bucket of 2 gives the decode attention its most context splits, kernels/mla_decode.py "
                         "auto_splits; 32 would give 4, 4x slower at 32K), the returning request's new tokens, full "
                         "prefill chunks; fewer, a shorter start")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"the engines to run, of {', '.join(KINDS)}: host-tier and a reference (all-resident, "
                         "else recompute)")
    args = ap.parse_args(argv)
    if args.smoke:
        ap.set_defaults(preset="tiny-deepseek-v2", dtype="float32", attn_impl="reference", moe_impl="dense",
                        page_size=16, contexts="256,512", output_len=8, turn_len=16, max_num_batched_tokens=128,
                        token_buckets="2,16,128")
        args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",")]
    if set(kinds) - set(KINDS) or "host-tier" not in kinds or len(set(kinds)) < 2:
        ap.error(f"--kinds must name the host tier and all-resident or recompute, of {', '.join(KINDS)}; "
                 f"got {args.kinds!r}")
    try:
        contexts = sorted({int(c) for c in args.contexts.split(",")})
        buckets = tuple(sorted({int(b) for b in args.token_buckets.split(",")}))
    except ValueError:
        ap.error(f"--contexts and --token-buckets must be comma-separated integers, got {args.contexts!r} and "
                 f"{args.token_buckets!r}")
    if args.pool_contexts < 1:
        ap.error(f"--pool-contexts must be at least 1 (the pool holds one longest context), got {args.pool_contexts}")
    ps, out, turn = args.page_size, args.output_len, args.turn_len
    if contexts[0] - turn - 2 * out < ps:
        ap.error(f"context {contexts[0]} leaves less than a page of prompt after --turn-len and --output-len")

    from deepinfer_jax.xla_env import use_host_memory

    use_host_memory(None, 1.0)  # pinned host memory: no VMM allocator, set before JAX starts (xla_env.py)
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.models.cache import kv_cache_bytes_per_page
    from deepinfer_jax.runner.compile_cache import enable_compilation_cache
    from deepinfer_jax.weights.random_init import random_params

    enable_compilation_cache("default")
    stamp(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    mib = 16 if args.smoke else 256
    h2d, d2h = link_bandwidth(mib)
    stamp(f"host link (pageable, {mib} MiB): host-to-device {h2d:.1f} GB/s, device-to-host {d2h:.1f} GB/s")
    from offload import pinned_link_bandwidth

    h2d, d2h = pinned_link_bandwidth(mib)
    stamp(f"host link (pinned, {mib} MiB): host-to-device {h2d:.1f} GB/s, device-to-host {d2h:.1f} GB/s")

    cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(HERE), "configs", "models", f"{args.preset}.json"))
    params = random_params(cfg, jnp.dtype(args.dtype), seed=0)
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    page_bytes = kv_cache_bytes_per_page(cfg, ps, args.dtype)
    longest = contexts[-1]
    small = cdiv(math.ceil(args.pool_contexts * longest), ps) + 1
    rng = np.random.default_rng(0)
    work = []
    for ctx in contexts:
        n = max(2, math.ceil(args.oversubscribe * (small - 1) * ps / ctx))
        prompts = [rng.integers(2, cfg.vocab_size, ctx - turn - 2 * out).tolist() for _ in range(n)]
        need = 1 + cdiv(ctx, ps) + (n - 1) * cdiv(ctx - turn - out, ps)
        work.append(dict(context=ctx, prompts=prompts, turn=rng.integers(2, cfg.vocab_size, turn).tolist(),
                         output_len=out, need_pages=need))
    pages = {"all-resident": max(w["need_pages"] for w in work), "host-tier": small, "recompute": small}
    tier_pages = math.ceil(1.25 * max(len(w["prompts"]) * cdiv(w["context"], ps) for w in work))
    tier_gib = tier_pages * page_bytes / 2**30
    stamp(f"{args.preset} ({args.dtype}, weights {weight_bytes / 2**30:.1f} GiB), page {ps} ({page_bytes:,} bytes); "
          f"pools: all-resident {pages['all-resident']:,} pages ({pages['all-resident'] * page_bytes / 2**30:.2f} "
          f"GiB), small {small:,} ({small * page_bytes / 2**30:.2f} GiB); host tier {tier_pages:,} pages "
          f"({tier_gib:.2f} GiB); sequences " + ", ".join(f"{len(w['prompts'])} x {w['context']:,}" for w in work))
    params_s = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True, logprobs=LOGPROBS,
                              output_kind=RequestOutputKind.DELTA)
    runner_kw = dict(dtype=args.dtype, attn_impl=args.attn_impl, moe_impl=args.moe_impl, token_buckets=buckets)
    results = {w["context"]: {} for w in work}
    for kind in [k for k in KINDS if k in kinds]:
        gib = tier_gib if kind == "host-tier" else 0.0
        t = time.perf_counter()
        eng = LLMEngine(cfg, params, None, num_pages=pages[kind], progress=False,
                        scheduler_config=SchedulerConfig(max_num_seqs=max(len(w["prompts"]) for w in work),
                                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                                         max_model_len=longest),
                        cache_config=CacheConfig(page_size=ps, kv_offloading_size=gib),
                        runner_config=RunnerConfig(**runner_kw))
        pool = "" if eng.runner.kv_transfer is None else (
            f"; tier pool in {'pinned' if eng.runner.kv_transfer.pinned else 'pageable'} host memory")
        stamp(f"{kind} engine: started in {time.perf_counter() - t:.1f} s{pool}")
        stamp(f"{kind} engine: warm-up {warm(eng, cfg.vocab_size, ps, params_s):.1f} s")
        for w in work:
            results[w["context"]][kind] = run_context(eng, kind, w, params_s)
        del eng
        gc.collect()
        for w in work:
            check(w, results[w["context"]], ps)
    for w in work:
        table(w, results[w["context"]], pages | {"all-resident": w["need_pages"]}, page_bytes)
    if "all-resident" in kinds:
        print(f"\n(all-resident's pool is each context's own need; its engine held {pages['all-resident']:,} pages.)")
    return results


def main(argv=None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
