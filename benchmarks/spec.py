"""Speculative decoding: what a verify step costs, and what n-gram, MTP and draft-model speculation give end to end.

    python benchmarks/spec.py                                          # GPU: the deepseek-v2-lite shape
    python benchmarks/spec.py --method deepseek_mtp --ks 1,2,3         # the same with an MTP layer (random)
    python benchmarks/spec.py --method deepseek_mtp --ks 1,2,3 --model deepinfer_jax/assets/default-model \\
        --page-size 16                                                 # MTP end to end, real acceptance
    python benchmarks/spec.py --preset tiny-deepseek-v2 --batches 1,4 --ks 1,2 --prompt-len 32 --steps 4 \\
        --attn-impl reference --moe-impl ragged --dtype float32       # CPU smoke run
    python benchmarks/spec.py --method deepseek_mtp --ks 1,2,3 --tp 2  # the same under a mesh layout:
    python benchmarks/spec.py --method deepseek_mtp --ks 1,2,3 --dp 2 --ep  # --tp, --dp (batch per rank), --ep

Random weights (the preset's shape). One engine a K (0: no speculation) with `max_num_seqs` = the largest batch.
First, for each K, a correctness check: greedy outputs with drafts equal to the target's own continuation
("forced acceptance", below) and with n-gram drafts must equal the outputs without speculation, token for token.

(1) Cost side, `verify`: every sequence of the batch verifies K drafts each step that the target rejects (random
ids), so each step emits one token a sequence at the price of K + 1 positions. Printed: ms a decode step for K = 0
and for each K, and the ratio. Acceptance length 1.0 by construction.

(2) End to end, per batch and K, three modes; each line gives the mean acceptance length measured beside the
figure (1 + accepted / sequences that verified drafts), the time a step, output tokens/s and the time per output
token (TPOT) against K = 0:
  * `ngram`: prompt lookup on copy-heavy prompts (a random passage repeated). Random weights do not copy, so the
    acceptance is what it is (usually ~1.0); with `--model DIR` (a trained checkpoint with a tokenizer) the
    prompts ask to repeat a passage of text, and the acceptance is real.
  * `forced acceptance` (labelled): drafts are the target's own greedy continuation (from the K = 0 run), so
    every draft is accepted: the ceiling at acceptance K + 1.
  * `draft_model` (`--draft`, labelled with the draft): a draft model with its own runner and paged cache proposes
    K greedy drafts a step (engine/spec_draft.py), its cost (catch-up and K draft steps) inside the step time.
    `--draft layers` (the default with random weights): the preset's shape cut to `--draft-layers` layers, random
    weights of its own: the cost side (a random draft is rejected: acceptance ~1.0). `--draft self` (with
    `--model`, e.g. the embedded default model): the checkpoint as its own draft, every draft accepted: the ceiling
    at acceptance K + 1 with the draft's real cost. `--draft DIR`: that checkpoint. Its correctness check (greedy
    outputs equal without speculation) runs first, as for the others.
Greedy sampling, EOS ignored, `--output-len` tokens a sequence; timing covers `--steps` steady decode steps after
the prefill.

`--method deepseek_mtp`: the engines with K > 0 speculate with the checkpoint's MTP layer (with random weights of
`--preset`, one random MTP layer is added), which drafts on the device in every step. `verify+draft (all
rejected)` is then the cost side (the MTP drafts K tokens a sequence each step, host drafts the target rejects),
`deepseek_mtp` the MTP's own drafts (acceptance ~1.0 on random weights, real with `--model`, e.g. the default
model), and `forced acceptance` the ceiling with the MTP's drafting cost included.

`--profile` (benchmarks/spec_profile.py): instead of the modes, for K = 0 and each K the engine's own drafts, with
the host's ms a timed step by phase (propose, schedule, inputs, launch, wait, results, update, emit), the device's
ms of the step program alone (run back to back: what a step costs where the host keeps ahead), and the optimized
HLO's op counts of each K's step program. A plain step overlaps its host work with the device; a speculating step
cannot plan the next before it knows the acceptance, so its wall time is about its host phases plus its device time:

    python benchmarks/spec.py --profile --method deepseek_mtp --ks 1,2,3 --batches 1,32 \
        --model deepinfer_jax/assets/default-model --page-size 16 --attn-impl reference --moe-impl ragged
    python benchmarks/spec.py --profile --method deepseek_mtp --ks 1,2,3,4 --batches 1,8,32,64  # V2-Lite shape
    python benchmarks/spec.py --profile --method deepseek_mtp --ks 1,2,3,4 --batches 1,8,32,64 \
        --preset deepseek-v3 --layers 2                     # V3's shape cut to 1 dense + 1 MoE layer, and its MTP
    python benchmarks/spec.py --profile --preset tiny-deepseek-v2 --method deepseek_mtp --batches 1 --ks 1,2 \
        --prompt-len 32 --steps 4 --attn-impl reference --moe-impl ragged --dtype float32 --token-buckets 16,64  # CPU

`--spec-overlap` (with `--profile`, `deepseek_mtp`): each K twice, fetched in turn and with the overlapped loop
(RunnerConfig.spec_overlap: step N + 1 planned before step N is fetched, as if N accepted every draft, corrected on
the device), rows told apart by `ovl`; the greedy outputs of both checked against K = 0's first:

    python benchmarks/spec.py --profile --spec-overlap --method deepseek_mtp --ks 1,2,3 --batches 1,32 \
        --model deepinfer_jax/assets/default-model --page-size 16 --attn-impl reference --moe-impl ragged

`--no-phases` (with `--profile`): the same loops without the phase timer, whose wrappers fetch each step's results
at once and so take a plain step's overlap of host and device away (a plain batch-1 step of the default model: 1.98
ms timed by phase, 1.00 ms unobserved); the step column is then what a user's loop sees.

The modes at the cut V3 take `--draft none` (a V3-shaped draft of its own would not fit beside it on one GPU).
At a cut V3 (`--layers`) each MTP pass (a whole MoE layer and the 129,280-row lm_head) weighs as much as a target
layer, so the cost side overstates what a 61-layer V3 pays; the ratio scales with 1 / layers.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

PASSAGE = ("The committee reviewed the proposal in detail and agreed that the new schedule would take effect at the "
           "start of the next quarter, provided that every team submitted its revised plan by the end of the month.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--model", default="", help="a checkpoint directory instead of random weights of --preset")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attn-impl", default="pallas")
    ap.add_argument("--moe-impl", default="pallas")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--draft", default="", help="draft_model mode: 'layers' (default with random weights), 'self' "
                    "(the --model checkpoint as its own draft), a checkpoint directory, or 'none'")
    ap.add_argument("--draft-layers", type=int, default=2, help="--draft layers: the draft's decoder layers")
    ap.add_argument("--method", default="ngram", choices=["ngram", "deepseek_mtp"])
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--dp", type=int, default=1, help="data_parallel_size (the batch spread over the ranks)")
    ap.add_argument("--ep", action="store_true", help="enable_expert_parallel")
    ap.add_argument("--layers", type=int, default=0, help="random weights: the preset cut to this many decoder "
                    "layers (its dense ones first; e.g. --preset deepseek-v3 --layers 2 fits one GPU)")
    ap.add_argument("--token-buckets", default="", help="the engines' token buckets (default: powers of two)")
    ap.add_argument("--profile", action="store_true", help="instead of the modes: for K = 0 and each K, the engine's "
                    "own drafts (--method), host ms a step by phase, device ms of the step program alone and its "
                    "optimized HLO's op counts (benchmarks/spec_profile.py)")
    ap.add_argument("--spec-overlap", action="store_true", help="--profile with --method deepseek_mtp: each K "
                    "twice, fetched in turn and overlapped (RunnerConfig.spec_overlap: the next step planned before "
                    "the one in flight is fetched); the table's `ovl` column tells them apart")
    ap.add_argument("--no-phases", action="store_true", help="--profile without the phase timer's wrappers: the "
                    "steps' wall times as a user's loop sees them (the phase columns and device ms left blank)")
    args = ap.parse_args(argv)
    if args.spec_overlap and not (args.profile and args.method == "deepseek_mtp"):
        ap.error("--spec-overlap needs --profile and --method deepseek_mtp")
    if args.no_phases and not args.profile:
        ap.error("--no-phases needs --profile")
    mtp = args.method == "deepseek_mtp"
    draft = args.draft or ("self" if args.model else "layers")
    if draft == "self" and not args.model:
        ap.error("--draft self needs --model (random weights differ between the target and a draft)")

    import jax
    import jax.numpy as jnp

    from deepinfer_jax.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
    from deepinfer_jax.engine import speculative
    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.runner.compile_cache import enable_compilation_cache
    from deepinfer_jax.types import SamplingParams

    enable_compilation_cache("default")
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    steps = args.steps
    buckets = tuple(int(b) for b in args.token_buckets.split(",")) if args.token_buckets else ()
    # the prefill's token, a few steps to settle, the timed steps, at up to K + 1 tokens a step
    output_len = (steps + 8) * (max(ks) + 1) + 2
    tokenizer = None
    if args.model:
        from deepinfer_jax.text import load_tokenizer
        from deepinfer_jax.weights.loader import prepare_model

        cfg, params = prepare_model(args.model, jnp.dtype(args.dtype))
        tokenizer = load_tokenizer(args.model)
    else:
        from deepinfer_jax.weights.random_init import random_params

        cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(HERE), "configs", "models",
                                                      f"{args.preset}.json"))
        import dataclasses

        if args.layers:
            cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers,
                                      first_k_dense_replace=min(cfg.first_k_dense_replace, args.layers - 1))
        if mtp and not cfg.has_mtp:  # one random MTP layer
            cfg = dataclasses.replace(cfg, num_nextn_predict_layers=1)
        params = random_params(cfg, jnp.dtype(args.dtype), seed=0)
    sharding = None
    if args.tp * args.dp > 1 or args.ep:  # every engine on the same layout (the draft model: on the first device)
        from deepinfer_jax.sharding import ParallelConfig, build_sharding

        sharding = build_sharding(cfg, ParallelConfig(args.tp, args.dp, args.ep))
        if sharding.vocab_multiple != 1:
            ap.error(f"--tp {args.tp} does not divide vocab_size {cfg.vocab_size}")
        params = params.result() if hasattr(params, "result") else params
        params = jax.device_put(params, sharding.fit_param_shardings(cfg, params))
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"{args.model or args.preset + ' (random weights)'}, TP={args.tp} DP={args.dp}{' EP' if args.ep else ''}",
          flush=True)
    rng = np.random.default_rng(0)
    vocab = cfg.vocab_size
    max_b = max(batches)
    if tokenizer is not None:
        text = f"Repeat the following passage exactly.\n\n{PASSAGE}\n\nRepeated:\n{PASSAGE[:60]}"
        base = tokenizer.encode(text)
        prompts = [base + rng.integers(2, vocab, 0).tolist() for _ in range(max_b)]
    else:  # a random passage, repeated: n-gram drafts find matches in the prompt
        prompts = []
        for _ in range(max_b):
            passage = rng.integers(2, vocab, 32).tolist()
            prompts.append((passage * (args.prompt_len // 32 + 1))[: args.prompt_len])
    max_len = max(len(p) for p in prompts) + output_len + max(ks) + 8

    draft_dir, draft_label = None, None
    if draft == "self":
        draft_dir, draft_label = args.model, "draft_model (self)"
    elif draft == "layers":  # the preset cut to a few layers, random weights (load_format dummy: drawn at load)
        import json
        import tempfile

        with open(os.path.join(os.path.dirname(HERE), "configs", "models", f"{args.preset}.json")) as f:
            small = json.load(f)
        small["num_hidden_layers"] = args.draft_layers
        small["first_k_dense_replace"] = min(small.get("first_k_dense_replace", 0), args.draft_layers - 1)
        draft_dir = tempfile.mkdtemp(prefix="spec-draft-")
        with open(os.path.join(draft_dir, "config.json"), "w") as f:
            json.dump(small, f)
        draft_label = f"draft_model ({args.draft_layers}-layer, random)"
    elif draft != "none":
        draft_dir, draft_label = draft, f"draft_model ({os.path.basename(draft.rstrip('/'))})"

    def engine(k: int, draft_model: str | None = None, overlap: bool | None = None) -> LLMEngine:
        t = time.time()
        spec = ({"method": "draft_model", "model": draft_model, "num_speculative_tokens": k} if draft_model else
                {"method": "deepseek_mtp", "num_speculative_tokens": k} if mtp else
                {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1})
        per_rank = -(-max_b // args.dp)  # max_num_seqs holds per data-parallel rank
        eng = LLMEngine(cfg, params, tokenizer, sharding=sharding,
                        scheduler_config=SchedulerConfig(max_num_seqs=per_rank, max_model_len=max_len,
                                                         max_num_batched_tokens=buckets[-1] if buckets else
                                                         max(2048, per_rank * (k + 1))),
                        cache_config=CacheConfig(page_size=args.page_size, enable_prefix_caching=False,
                                                 gpu_memory_utilization=0.85),
                        runner_config=RunnerConfig(dtype=args.dtype, attn_impl=args.attn_impl, moe_impl=args.moe_impl,
                                                   token_buckets=buckets, spec_overlap=overlap),
                        progress=False, speculative_config=None if k == 0 else spec,
                        load_format="auto" if args.model else "dummy")
        print(f"K={k}{' ' + draft_label if draft_model else ''}{' overlapped' if eng.spec_overlap else ''}: ready in {time.time() - t:.1f} s "
              f"({eng.num_warmup_compiles} programs)", flush=True)
        return eng

    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ngram = speculative.propose  # the engine's own proposer (n-gram, or the MTP's drafts)
    own = args.method if mtp else "ngram"

    def run(eng, b: int, proposer=None, timed: bool = True):
        """Generate for the first b prompts; -> (outputs by id, ms a timed step (median), output tokens a timed step
        (mean), mean acceptance length over the timed steps)."""
        speculative.propose = proposer or ngram
        compiled = compiles(eng)
        try:
            for i in range(b):
                eng.add_request(str(i), prompts[i], sp)
            mine = [eng.scheduler.requests[str(i)] for i in range(b)]
            outs, times, tokens = {}, [], 0
            st0 = None
            n = 0
            while eng.has_unfinished_requests():
                reqs = eng.scheduler.running
                decoding = len(reqs) == b and all(r.num_tokens - r.num_computed_tokens == 1 for r in reqs)
                before = sum(r.num_output_tokens for r in mine)
                t = time.perf_counter()
                for o in eng.step():
                    if o.finished:
                        outs[o.request_id] = o.outputs[0].token_ids
                elapsed = time.perf_counter() - t
                if timed and decoding and 4 <= n < 4 + steps:
                    if st0 is None and eng.spec_stats is not None:
                        st0 = (eng.spec_stats.num_drafts, eng.spec_stats.num_accepted_tokens)
                    times.append(elapsed)
                    tokens += sum(r.num_output_tokens for r in mine) - before
                n += decoding
            acc = 1.0
            if st0 is not None and eng.spec_stats.num_drafts > st0[0]:
                acc = 1 + (eng.spec_stats.num_accepted_tokens - st0[1]) / (eng.spec_stats.num_drafts - st0[0])
            # tokens a timed step, at the median step time
            if compiles(eng) != compiled:  # a step shape warm-up missed: the step times include its compiles
                print(f"K={eng.spec.num_speculative_tokens if eng.spec else 0} batch {b}: "
                      f"{compiles(eng) - compiled} compiles after warm-up", flush=True)
            return outs, 1e3 * float(np.median(times)) if times else float("nan"), tokens / max(len(times), 1), acc
        finally:
            speculative.propose = ngram

    def compiles(eng) -> int:  # the target's (and the draft model's) compiles after warm-up
        return eng.runner.compiles_after_warmup + (eng.drafter.runner.compiles_after_warmup if eng.drafter else 0)

    def rejected(eng):  # K drafts a sequence that the target (random weights) rejects
        k = eng.spec.num_speculative_tokens
        for r in eng.scheduler.running:
            if r.num_tokens - r.num_computed_tokens == 1:
                r.spec_token_ids = [(r.output_token_ids[-1] + 1 + i) % vocab for i in range(k)]

    def forced(ref):
        def propose(eng):  # the target's own greedy continuation: every draft accepted
            k = eng.spec.num_speculative_tokens
            for r in eng.scheduler.running:
                if r.num_tokens - r.num_computed_tokens == 1:
                    r.spec_token_ids = ref[r.request_id][r.num_output_tokens: r.num_output_tokens + k]
        return propose

    if args.profile:
        return profile(engine, prompts, sp, batches, ks, steps, args.spec_overlap, phases=not args.no_phases)
    plain = engine(0)
    base = {b: run(plain, b) for b in batches}  # each batch's greedy outputs are its forced drafts
    del plain  # its KV cache goes before the next engine sizes its own
    gc.collect()
    rows = []
    for k in ks:
        eng = engine(k)
        b = min(batches)
        ref = base[b][0]
        for name, prop in (("forced", forced(ref)), (own, None)):
            outs = run(eng, b, prop, timed=False)[0]
            same = sum(outs[i] == ref[i] for i in ref)
            # bf16 logits of a K + 1-position step may differ from a one-position step's in the last bit, which can
            # flip a near-tie; a wrong verification changes nearly every output
            print(f"K={k}: {name} drafts: {same} of {len(ref)} greedy outputs equal without speculation", flush=True)
            if 2 * same < len(ref):
                print(f"K={k}: FAILED: {name} drafts change the greedy output", flush=True)
                return 1
        for b in batches:
            _, ms0, tok0, _ = base[b]
            _, ms_v, tok_v, acc_v = run(eng, b, rejected)
            rows.append(("verify+draft (all rej.)" if mtp else "verify (all rejected)", k, b, ms0, tok0, ms_v, tok_v,
                         acc_v))
            for name, prop in ((own, None), ("forced acceptance", forced(base[b][0]))):
                _, ms, tok, acc = run(eng, b, prop)
                rows.append((name, k, b, ms0, tok0, ms, tok, acc))
        del eng
        gc.collect()
        if draft_dir is None:
            continue
        eng = engine(k, draft_dir)
        b = min(batches)
        outs = run(eng, b, timed=False)[0]
        same = sum(outs[i] == base[b][0][i] for i in base[b][0])
        print(f"K={k}: {draft_label} drafts: {same} of {len(outs)} greedy outputs equal without speculation", flush=True)
        if 2 * same < len(outs):
            print(f"K={k}: FAILED: {draft_label} drafts change the greedy output", flush=True)
            return 1
        for b in batches:
            _, ms0, tok0, _ = base[b]
            _, ms, tok, acc = run(eng, b)
            rows.append((draft_label, k, b, ms0, tok0, ms, tok, acc))
        del eng
        gc.collect()
    print()
    print(f"{'mode':<23} {'K':>2} {'batch':>5} {'accept len':>10} {'step ms K=0':>11} {'step ms':>8} "
          f"{'ratio':>6} {'tok/s K=0':>10} {'tok/s':>9} {'TPOT x':>7}")
    for name, k, b, ms0, tok0, ms, tok, acc in rows:
        tps0, tps = tok0 / (ms0 / 1e3), tok / (ms / 1e3)
        print(f"{name:<23} {k:>2} {b:>5} {acc:>10.2f} {ms0:>11.2f} {ms:>8.2f} {ms / ms0:>6.2f} {tps0:>10.1f} "
              f"{tps:>9.1f} {tps0 / tps if tps else float('nan'):>7.2f}")
    print("\nTPOT x: time per output token with speculation / without (below 1: faster). tok/s: output tokens a "
          "timed step (mean) over the median step time.")
    return 0


def real_tokens(requests) -> int:
    """Output tokens the requests hold, not counting the overlapped loop's placeholders (ids < 0) for the tokens
    of the step in flight."""
    return sum(sum(1 for t in r.output_token_ids if t >= 0) for r in requests)


def profile(engine, prompts, sp, batches, ks, steps, overlap: bool = False, phases: bool = True) -> int:
    """--profile: for K = 0 and each K, at each batch, the engine's own drafts: host ms a timed step by phase
    (spec_profile.PhaseTimer), the step's wall ms (median), the device ms of its program alone and, at the first
    batch, the optimized HLO's op counts. Checks first that each K's greedy outputs equal K = 0's. `overlap`: each K
    also with RunnerConfig.spec_overlap (rows with ovl = yes; its steps' overlapped count in `ovl steps`).
    `phases` False: no phase timer (spec_profile.StepsOnly), the step times as the engine runs unobserved."""
    from benchmarks.spec_profile import PHASES, OPS, PhaseTimer, StepsOnly, device_ms, op_counts

    rows, counts, ref = [], {}, {}
    for k, ovl in [(0, False), *((k, False) for k in ks), *((k, True) for k in ks if overlap)]:
        eng = engine(k, overlap=ovl)
        timer = PhaseTimer(eng) if phases else StepsOnly()
        timer.install_propose(None)
        try:
            for b in batches:
                for i in range(b):
                    eng.add_request(str(i), prompts[i], sp)
                mine = [eng.scheduler.requests[str(i)] for i in range(b)]
                outs, times, tokens, n, st0 = {}, [], 0, 0, None
                compiled = eng.runner.compiles_after_warmup
                while eng.has_unfinished_requests():
                    reqs = eng.scheduler.running
                    decoding = len(reqs) == b and all(r.num_tokens - r.num_computed_tokens == 1 for r in reqs)
                    timer.active = decoding and 4 <= n < 4 + steps
                    if timer.active and st0 is None and eng.spec_stats is not None:
                        st0 = (eng.spec_stats.num_drafts, eng.spec_stats.num_accepted_tokens)
                    before = real_tokens(mine)
                    t = time.perf_counter()
                    for o in eng.step():
                        if o.finished:
                            outs[o.request_id] = o.outputs[0].token_ids
                    if timer.active:
                        times.append(time.perf_counter() - t)
                        timer.steps += 1
                        tokens += real_tokens(mine) - before
                    n += decoding
                timer.active = False
                if k == 0:
                    ref[b] = outs
                elif outs != ref[b]:
                    same = sum(outs[i] == ref[b][i] for i in ref[b])
                    print(f"K={k} batch {b}: {same} of {b} greedy outputs equal without speculation", flush=True)
                    if 2 * same < b:
                        print(f"K={k}: FAILED: its drafts change the greedy output", flush=True)
                        return 1
                acc = 1.0
                if st0 is not None and eng.spec_stats.num_drafts > st0[0]:
                    acc = 1 + (eng.spec_stats.num_accepted_tokens - st0[1]) / (eng.spec_stats.num_drafts - st0[0])
                host = timer.last_host
                dev = device_ms(eng, host) if host is not None else float("nan")
                if b == batches[0] and host is not None:
                    counts[k, ovl] = op_counts(eng, host)
                rows.append((k, b, acc, timer.per_step(), 1e3 * float(np.median(times)) if times else float("nan"),
                             tokens / max(len(times), 1), dev, eng.runner.compiles_after_warmup - compiled, ovl))
                timer.reset()
        finally:
            timer.restore_propose()
        del eng, timer  # the timer holds the engine: both go before the next engine takes its KV cache
        gc.collect()
    print("\nhost ms a timed step by phase (benchmarks/spec_profile.py); step: wall ms (median); device: the step "
          "program alone, ms a run; TPOT x: ms a token against K = 0's at the batch; overlapped: the same were the "
          "host's work hidden behind the device (max(host sum, device) a step: the ceiling of an overlapped loop); "
          "compiles: after warm-up, in the run")
    print(f"{'K':>2} {'ovl':>3} {'batch':>5} {'accept':>6} " + " ".join(f"{p:>8}" for p in PHASES) +
          f" {'host sum':>8} {'step':>7} {'device':>7} {'tok/step':>8} {'TPOT x':>6} {'overlapped':>10} {'compiles':>8}")
    plain = {b: ms / tok for k, b, _, _, ms, tok, _, _, _ in rows if k == 0 and tok}
    for k, b, acc, ph, ms, tok, dev, comp, ovl in rows:
        if not tok:
            print(f"{k:>2} {'yes' if ovl else 'no':>3} {b:>5}  no timed steps: the batch never decoded all at once (the prefills of the others "
                  "did not fit the token budget: larger --token-buckets)")
            continue
        host = sum(v for p, v in ph.items() if p != "wait")
        base = plain.get(b, float("nan"))
        print(f"{k:>2} {'yes' if ovl else 'no':>3} {b:>5} {acc:>6.2f} " + " ".join(f"{ph[p]:>8.3f}" for p in PHASES) +
              f" {host:>8.3f} {ms:>7.2f} {dev:>7.2f} {tok:>8.2f} {ms / tok / base:>6.2f} "
              f"{max(host, dev) / tok / base:>10.2f} {comp:>8}")
    print(f"\noptimized HLO op counts of the step program at batch {batches[0]}")
    print(f"{'K':>2} {'ovl':>3} " + " ".join(f"{o:>11}" for o in OPS))
    for (k, ovl), c in counts.items():
        print(f"{k:>2} {'yes' if ovl else 'no':>3} " + " ".join(f"{c[o]:>11}" for o in OPS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
