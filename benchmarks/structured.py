"""Structured-output overhead: the same offline batch decoded free and under a JSON grammar, at several batch sizes,
with the host's bitmask time per step and the sampling variant each run's steps took.

    python benchmarks/structured.py                   # GPU: the deepseek-v2-lite shape, batches 1, 32, 128
    python benchmarks/structured.py --smoke           # CPU: the tiny preset at tiny shapes (the script's own check)
    python benchmarks/structured.py --mask-only       # the host's mask fill alone (llguidance), no model, any machine
    python benchmarks/structured.py --samplers        # each sampling variant's sampler alone on the device

Random weights (the preset's shape), `--prompt-len` random prompt ids, `--output-len` tokens a sequence, ignore
EOS, temperature 1. The constrained runs hold every sequence to JSON lines of a realistic record schema (nested
object, bounded integer, enum array, string patterns) that never completes, so each sequence decodes exactly
`--output-len` tokens, as the free run does. The tokenizer: `--tokenizer DIR` (a real model's tokenizer.json,
e.g. DeepSeek-V2-Lite's: the realistic mask cost), else a byte-level BPE of the preset's vocabulary size
trained on this Python's standard library (cached in --cache-dir; ~30 s for 102,400 tokens).

Four runs a batch, each line with its output tokens/s, time a step and the steps by sampling variant:
  * `free`: unconstrained (the base variant);
  * `free+lp`: unconstrained with logprobs=0, so every step samples in the full variant: its cost alone;
  * `json`: constrained; its steps sample in the mask variant (the plain sampler and the bitmask), the forward and
    the sampler two programs, the masks filled on the host while the forward runs (docs/structured-output.md);
  * `json+lp`: constrained with logprobs=0: the full variant, for comparison.
Then the overhead of `json` (and `json+lp`) against `free`, the host's mask fill per constrained step (mean, p50,
p90 and per row: ModelRunner.last_mask_fill_seconds, llguidance's thread pool) beside the decode step time, and the
checks: every complete record parses and validates, and `json` and `json+lp` sampled the same tokens (same
forward, same keys; a difference is reported, and is expected only where the device's forward is not
deterministic). The script exits 1 on an invalid record.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,10}\\.(com|org|net)$"},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "admin", "guest"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
# JSON lines of records that never complete: every sequence decodes --output-len tokens.
GRAMMAR = "start: rec (\"\\n\" rec)*\nrec: %json " + json.dumps(
    {**RECORD, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}})
SMOKE = {"preset": "tiny-deepseek-v2", "batches": "1,4", "prompt_len": 16, "output_len": 96, "dtype": "float32",
         "attn_impl": "reference", "moe_impl": "ragged", "max_num_batched_tokens": 64, "page_size": 8}


def train_tokenizer(vocab_size: int, path: str, max_files: int | None = None) -> None:
    """A byte-level BPE of `vocab_size` tokens (BOS 0, EOS 1) trained on the standard library's sources (the first
    `max_files` of them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def utf8(f):
        try:
            with open(f, encoding="utf-8") as fh:
                fh.read()
            return True
        except (UnicodeDecodeError, OSError):
            return False

    files = [f for f in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "**", "*.py"), recursive=True))
             if utf8(f)][:max_files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)


def model_dir(args, cfg_path: str, vocab_size: int) -> str:
    """A folder with the preset's config.json and a tokenizer (module docstring)."""
    import shutil

    d = os.path.join(args.cache_dir, f"structured-{os.path.basename(cfg_path)[:-5]}")
    os.makedirs(d, exist_ok=True)
    shutil.copyfile(cfg_path, os.path.join(d, "config.json"))
    if args.tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            src = os.path.join(args.tokenizer, name)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(d, name))
        return d
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:  # the trained BPE's BOS / EOS: the preset's ids are text
        json.dump({**cfg, "bos_token_id": 0, "eos_token_id": 1}, f)
    tj = os.path.join(d, "tokenizer.json")
    if not os.path.exists(tj):
        t = time.time()
        train_tokenizer(vocab_size, tj, max_files=200 if vocab_size < 4096 else None)
        print(f"trained a {vocab_size}-token byte-level BPE in {time.time() - t:.1f} s", flush=True)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True}, f)
    return d


def _stats(seconds: list[float]) -> dict:
    ms = np.array(seconds or [0.0]) * 1e3
    return {"mean": float(ms.mean()), "p50": float(np.median(ms)), "p90": float(np.percentile(ms, 90))}


def mask_only(args, cfg, tokenizer, batches: list[int]) -> int:
    """The host's mask fill alone: `batch` matchers of the benchmark's grammar, each step one fill of all their rows
    (GrammarMatcher.fill_bitmasks, as a constrained step does), then each matcher advanced by a random allowed
    token. Prints ms a step and a row."""
    from deepinfer_jax.text.grammar import GrammarCompiler, GrammarMatcher, allowed_ids, mask_words
    from deepinfer_jax.types import StructuredOutputsParams

    # the engine's EOS ids: the model's and the tokenizer's (the trained BPE's table may stop below the model's)
    eos = tuple(dict.fromkeys(tuple(cfg.eos_token_ids) + tuple(tokenizer.eos_token_ids or ())))
    compiler = GrammarCompiler(tokenizer, cfg.vocab_size, eos)
    spec = StructuredOutputsParams(grammar=GRAMMAR)
    rng = np.random.default_rng(0)
    print(f"host mask fill, {os.cpu_count()} CPUs, vocabulary {cfg.vocab_size}, {args.output_len} steps a batch")
    for batch in batches:
        matchers = [compiler.matcher(spec) for _ in range(batch)]
        bits = np.full((batch, mask_words(cfg.vocab_size)), -1, np.int32)
        times = []
        for _ in range(args.output_len):
            t = time.perf_counter()
            GrammarMatcher.fill_bitmasks([(m, i) for i, m in enumerate(matchers)], bits)
            times.append(time.perf_counter() - t)
            for i, m in enumerate(matchers):
                ids = allowed_ids(bits[i], cfg.vocab_size)
                if not m.accept(int(rng.choice(ids))):
                    raise SystemExit(f"row {i}: the matcher refused an allowed token ({m.error})")
        s = _stats(times[1:])
        print(f"batch {batch:4d}: {s['mean']:.3f} ms a step (p50 {s['p50']:.3f}, p90 {s['p90']:.3f}), "
              f"{s['mean'] / batch:.4f} ms a row", flush=True)
    return 0


def samplers(args, cfg, batches: list[int], iters: int = 50) -> int:
    """The sampler of each variant alone on the device (sampling.sample as the step programs call it), `iters`
    samples in one program on random logits [batch, vocab]: base, greedy, mask (all rows free: an all-ones mask;
    half the rows constrained to ~1% of the vocabulary; the same with the logit_bias stage, which the mask variant
    leaves to the full one) and full (with the penalty histories, bias entries and the mask of the engine's shapes,
    `max_logprobs` 20). Prints us a sample."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from deepinfer_jax.sampling import SamplingTensors, sample
    from deepinfer_jax.text.grammar import mask_words
    from deepinfer_jax.types import MAX_LOGIT_BIAS

    V, W, L = cfg.vocab_size, mask_words(cfg.vocab_size), args.prompt_len + args.output_len + 8
    print(f"device: {jax.devices()[0].device_kind}; vocabulary {V}; us a sample, {iters} in one program")

    def timed(logits, st, variant) -> float:
        full, draw = variant == "full", variant != "greedy"

        @jax.jit
        def loop(logits, st):
            def body(i, acc):
                out = sample(logits + i.astype(jnp.float32) * 1e-6, st, max_logprobs=20 if full else 0, full=full,
                             draw=draw)
                return acc + out.token_ids.sum() + out.logprob.sum().astype(jnp.int32)
            return jax.lax.fori_loop(0, iters, body, jnp.int32(0))

        loop(logits, st).block_until_ready()
        t = time.perf_counter()
        for _ in range(5):
            r = loop(logits, st)
        r.block_until_ready()
        return 1e6 * (time.perf_counter() - t) / (5 * iters)

    rng = np.random.default_rng(0)
    for batch in batches:
        logits = jnp.asarray(rng.normal(size=(batch, V)).astype(np.float32))
        keys = rng.integers(0, 2**32, (batch, 2), dtype=np.uint64).astype(np.uint32)
        base = dataclasses.replace(SamplingTensors.defaults(batch, suppress_len=8), rng_key_data=keys)
        ones = dataclasses.replace(base, allowed_token_bits=np.full((batch, W), -1, np.int32))
        bits = np.where(rng.random((batch, W)) < 0.01, -1, 0).astype(np.int32)
        bits[batch // 2:] = -1
        half = dataclasses.replace(ones, allowed_token_bits=bits)
        bias = SamplingTensors.defaults(batch, bias_len=MAX_LOGIT_BIAS)
        bias.logit_bias_ids[:, :4] = rng.integers(0, V, (batch, 4))
        bias = dataclasses.replace(half, logit_bias_ids=bias.logit_bias_ids, logit_bias_values=bias.logit_bias_values)
        full = dataclasses.replace(SamplingTensors.defaults(batch, L, L, 8, W, MAX_LOGIT_BIAS), rng_key_data=keys)
        cases = (("base", base, "base"), ("greedy", dataclasses.replace(base, temperature=np.zeros(batch, np.float32)),
                                          "greedy"),
                 ("mask, all ones", ones, "mask"), ("mask, half constrained", half, "mask"),
                 ("mask with logit_bias", bias, "mask"), ("full", full, "full"))
        line = ", ".join(f"{name} {timed(logits, st, variant):.1f}" for name, st, variant in cases)
        print(f"batch {batch:4d}: {line}", flush=True)
    return 0


def run_one(eng, name: str, prompts, sp) -> tuple[dict, dict]:
    """Decode `prompts` under `sp`: (figures, request id -> output token ids)."""
    runner = eng.runner
    before = dict(runner.steps_by_variant)
    for i, p in enumerate(prompts):
        eng.add_request(f"{name}-{len(prompts)}-{i}", p, sp)
    steps, fills, t = 0, [], time.perf_counter()
    tokens, texts, ended = {}, [], 0
    eos = set(eng.eos_token_ids)
    while eng.has_unfinished_requests():
        n = runner.mask_fills
        for out in eng.step():
            ids = list(out.outputs[0].token_ids)
            tokens[out.request_id] = ids
            # ignore_eos decodes on past an EOS the grammar allowed (after a complete record); what a request
            # returns ends there, so the records are read from the tokens before the first EOS.
            cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
            ended += cut < len(ids)
            texts.append(eng.tokenizer.decode(ids[:cut]) + ("\n" if cut < len(ids) else ""))
        if runner.mask_fills > n:
            fills.append(runner.last_mask_fill_seconds)
        steps += 1
    dt = time.perf_counter() - t
    variants = {v: c - before.get(v, 0) for v, c in runner.steps_by_variant.items() if c > before.get(v, 0)}
    row = {"tok_s": len(prompts) * sp.max_tokens / dt, "step_ms": 1e3 * dt / steps, "variants": variants}
    if sp.structured_outputs is not None:
        row["mask_ms"] = _stats(fills)
        row["records_valid"] = _count_valid(texts)
        row["ended_by_eos"] = ended
    return row, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attn-impl", default="pallas")
    ap.add_argument("--moe-impl", default="pallas")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--token-buckets", default="", help="comma-separated token buckets to compile (default: the "
                    "engine's); e.g. 32,16384 for batch 32 x 512 alone, a shorter start-up")
    ap.add_argument("--tokenizer", default="", help="a folder with the model's tokenizer.json (and its config)")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "deepinfer-bench"))
    ap.add_argument("--smoke", action="store_true", help="CPU check at tiny shapes: " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in SMOKE.items()))
    ap.add_argument("--mask-only", action="store_true", help="time the host's mask fill alone (no model)")
    ap.add_argument("--samplers", action="store_true", help="time each sampling variant's sampler alone")
    ap.add_argument("--json", default="", help="write the figures to this file")
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.text import load_tokenizer

    cfg_path = os.path.join(os.path.dirname(HERE), "configs", "models", f"{args.preset}.json")
    cfg = ModelConfig.from_json_file(cfg_path)
    batches = [int(b) for b in args.batches.split(",")]
    if args.samplers:
        return samplers(args, cfg, batches)
    d = model_dir(args, cfg_path, cfg.vocab_size)
    tokenizer = load_tokenizer(d)
    cfg = ModelConfig.from_json_file(os.path.join(d, "config.json"))  # with the tokenizer's BOS / EOS ids
    if args.mask_only:
        return mask_only(args, cfg, tokenizer, batches)

    import jax
    import jax.numpy as jnp

    from deepinfer_jax.config import CacheConfig, RunnerConfig, SchedulerConfig
    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.runner.compile_cache import enable_compilation_cache
    from deepinfer_jax.types import RequestOutputKind, SamplingParams, StructuredOutputsParams
    from deepinfer_jax.weights.random_init import random_params

    enable_compilation_cache("default")
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), tokenizer {tokenizer}", flush=True)
    t0 = time.time()
    params = random_params(cfg, jnp.dtype(args.dtype), seed=0)
    eng = LLMEngine(
        cfg, params, tokenizer,
        scheduler_config=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=args.max_num_batched_tokens,
                                         max_model_len=args.prompt_len + args.output_len + 8),
        cache_config=CacheConfig(page_size=args.page_size, enable_prefix_caching=False, gpu_memory_utilization=0.85),
        runner_config=RunnerConfig(dtype=args.dtype, attn_impl=args.attn_impl, moe_impl=args.moe_impl, **(
            {"token_buckets": tuple(sorted(int(b) for b in args.token_buckets.split(",")))}
            if args.token_buckets else {})),
        progress=False)
    print(f"ready in {time.time() - t0:.1f} s ({eng.num_warmup_compiles} programs; mask variant: "
          f"{eng.runner.has_mask_variant()})", flush=True)

    spec = StructuredOutputsParams(grammar=GRAMMAR)
    rng = np.random.default_rng(0)
    results, bad = [], 0
    runs = (("free", None, None), ("free+lp", None, 0), ("json", spec, None), ("json+lp", spec, 0))
    for name, so, lp in runs:  # untimed: each run's first steps after warm-up
        sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=lp, structured_outputs=so)
        run_one(eng, f"warm-{name}", [list(range(100, 100 + args.prompt_len))] * batches[0], sp)
    for batch in batches:
        prompts = [rng.integers(100, min(cfg.vocab_size, 100000), args.prompt_len).tolist() for _ in range(batch)]
        row, toks = {"batch": batch}, {}
        for name, so, lp in runs:
            sp = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=1, logprobs=lp,
                                structured_outputs=so, output_kind=RequestOutputKind.FINAL_ONLY)
            row[name], got = run_one(eng, name, prompts, sp)
            toks[name] = [got[f"{name}-{batch}-{i}"] for i in range(batch)]
            r = row[name]
            print(f"batch {batch:4d} {name:8s}: {r['tok_s']:10.1f} tok/s, {r['step_ms']:7.2f} ms a step, "
                  f"steps by variant {r['variants']}", flush=True)
        free = row["free"]["tok_s"]
        row["overhead_pct"] = 100 * (1 - row["json"]["tok_s"] / free)
        row["overhead_full_pct"] = 100 * (1 - row["json+lp"]["tok_s"] / free)
        row["same_tokens"] = toks["json"] == toks["json+lp"]
        m = row["json"]["mask_ms"]
        good, total = row["json"]["records_valid"]
        good_f, total_f = row["json+lp"]["records_valid"]
        bad += (total - good) + (total_f - good_f)
        print(f"batch {batch:4d}: overhead {row['overhead_pct']:.1f}% (mask variant), "
              f"{row['overhead_full_pct']:.1f}% (full variant); host mask {m['mean']:.3f} ms a step (p50 "
              f"{m['p50']:.3f}, p90 {m['p90']:.3f}; {m['mean'] / batch:.4f} ms a row) beside a "
              f"{row['json']['step_ms']:.2f} ms step; records valid {good}/{total} and {good_f}/{total_f} "
              f"({row['json']['ended_by_eos']} of {batch} sequences sampled EOS after a record); "
              f"json and json+lp tokens {'equal' if row['same_tokens'] else 'DIFFER'}", flush=True)
        results.append(row)

    print("\n| batch | free tok/s | json tok/s | overhead | json+lp tok/s | overhead | host mask ms/step | json variant |")
    print("|---|---|---|---|---|---|---|---|")
    for row in results:
        print(f"| {row['batch']} | {row['free']['tok_s']:.1f} | {row['json']['tok_s']:.1f} | "
              f"{row['overhead_pct']:.1f}% | {row['json+lp']['tok_s']:.1f} | {row['overhead_full_pct']:.1f}% | "
              f"{row['json']['mask_ms']['mean']:.3f} | {', '.join(row['json']['variants'])} |")
    print(f"recompiles after warm-up: {eng.runner.compiles_after_warmup}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    if bad:
        print(f"FAILED: {bad} complete records did not validate")
    return 1 if bad or eng.runner.compiles_after_warmup else 0


def _count_valid(texts: list[str]) -> tuple[int, int]:
    """(records that parse and validate against RECORD, complete records): every line but each text's last."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    good = total = 0
    for text in texts:
        for line in text.split("\n")[:-1]:
            total += 1
            try:
                rec = json.loads(line)
                if jsonschema is not None:
                    jsonschema.validate(rec, RECORD)
                good += 1
            except Exception:  # noqa: BLE001 - counted as invalid
                pass
    return good, total


if __name__ == "__main__":
    sys.exit(main())
