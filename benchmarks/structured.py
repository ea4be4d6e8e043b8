"""Structured-output overhead: the same offline batch decoded free and under a JSON grammar, at several batch sizes,
with the host's bitmask time per step.

    python benchmarks/structured.py                                   # GPU: the deepseek-v2-lite shape
    python benchmarks/structured.py --preset tiny-deepseek-v2 --batches 1,8 --prompt-len 32 --output-len 16 \\
        --attn-impl reference --moe-impl ragged --dtype float32      # CPU

Random weights (the preset's shape), `--prompt-len` random prompt ids, `--output-len` tokens a sequence, ignore
EOS, temperature 1. The constrained run holds every sequence to JSON lines of a realistic record schema (nested
object, bounded integer, enum array, string patterns) that never completes, so each sequence decodes exactly
`--output-len` tokens, as the free run does. The tokenizer: `--tokenizer DIR` (a real model's tokenizer.json,
e.g. DeepSeek-V2-Lite's: the realistic mask cost), else a byte-level BPE of the preset's vocabulary size
trained on this Python's standard library (cached in --cache-dir; ~30 s for 102,400 tokens).

Prints per batch: output tokens/s free, free in the full sampling variant (logprobs=0: where constrained steps
sample, so the difference to "free" is that variant's cost and the rest the grammar's: the mask, and the fetch of
the step before it, which a constrained step waits for), and constrained; the overhead against free; the decode
step time; the host's mask fill time per constrained step (mean, p50, p90; text/grammar.py
GrammarMatcher.fill_bitmasks, on llguidance's thread pool); and how many complete records validate.
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


def train_tokenizer(vocab_size: int, path: str) -> None:
    """A byte-level BPE of `vocab_size` tokens (BOS 0, EOS 1) trained on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def utf8(f):
        try:
            with open(f, encoding="utf-8") as fh:
                fh.read()
            return True
        except (UnicodeDecodeError, OSError):
            return False

    files = [f for f in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "**", "*.py"), recursive=True))
             if utf8(f)]
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
    tj = os.path.join(d, "tokenizer.json")
    if not os.path.exists(tj):
        t = time.time()
        train_tokenizer(vocab_size, tj)
        print(f"trained a {vocab_size}-token byte-level BPE in {time.time() - t:.1f} s", flush=True)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True}, f)
    return d


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
    ap.add_argument("--tokenizer", default="", help="a folder with the model's tokenizer.json (and its config)")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "deepinfer-bench"))
    ap.add_argument("--json", default="", help="write the figures to this file")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from deepinfer_jax.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.runner.compile_cache import enable_compilation_cache
    from deepinfer_jax.text import load_tokenizer
    from deepinfer_jax.text.grammar import GrammarMatcher, tool_call_grammar  # noqa: F401 (the room's API)
    from deepinfer_jax.types import RequestOutputKind, SamplingParams, StructuredOutputsParams
    from deepinfer_jax.weights.random_init import random_params

    enable_compilation_cache("default")
    cfg_path = os.path.join(os.path.dirname(HERE), "configs", "models", f"{args.preset}.json")
    cfg = ModelConfig.from_json_file(cfg_path)
    tokenizer = load_tokenizer(model_dir(args, cfg_path, cfg.vocab_size))
    batches = [int(b) for b in args.batches.split(",")]
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), tokenizer {tokenizer}", flush=True)
    t0 = time.time()
    params = random_params(cfg, jnp.dtype(args.dtype), seed=0)
    eng = LLMEngine(
        cfg, params, tokenizer,
        scheduler_config=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=args.max_num_batched_tokens,
                                         max_model_len=args.prompt_len + args.output_len + 8),
        cache_config=CacheConfig(page_size=args.page_size, enable_prefix_caching=False, gpu_memory_utilization=0.85),
        runner_config=RunnerConfig(dtype=args.dtype, attn_impl=args.attn_impl, moe_impl=args.moe_impl),
        progress=False)
    print(f"ready in {time.time() - t0:.1f} s ({eng.num_warmup_compiles} programs)", flush=True)

    fill_times: list[float] = []
    fill = GrammarMatcher.fill_bitmasks

    def timed_fill(rows, bits):
        t = time.perf_counter()
        fill(rows, bits)
        fill_times.append(time.perf_counter() - t)

    GrammarMatcher.fill_bitmasks = staticmethod(timed_fill)
    # JSON lines of records that never complete: every sequence decodes --output-len tokens.
    grammar = "start: rec (\"\\n\" rec)*\nrec: %json " + json.dumps(
        {**RECORD, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}})
    spec = StructuredOutputsParams(grammar=grammar)
    rng = np.random.default_rng(0)
    results = []
    for batch in batches:
        prompts = [rng.integers(100, min(cfg.vocab_size, 100000), args.prompt_len).tolist() for _ in range(batch)]
        row = {"batch": batch}
        for name, so, lp in (("free", None, None), ("full", None, 0), ("json", spec, None)):
            fill_times.clear()
            sp = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=1, logprobs=lp,
                                structured_outputs=so, output_kind=RequestOutputKind.FINAL_ONLY)
            for i, p in enumerate(prompts):
                eng.add_request(f"{name}-{batch}-{i}", p, sp)
            steps, t = 0, time.perf_counter()
            texts = []
            while eng.has_unfinished_requests():
                for out in eng.step():
                    texts.append(out.outputs[0].text)
                steps += 1
            dt = time.perf_counter() - t
            row[f"{name}_tok_s"] = batch * args.output_len / dt
            row[f"{name}_step_ms"] = 1e3 * dt / steps
            if so is not None:
                ft = np.array(fill_times[1:] or [0.0]) * 1e3  # the first is the prefill's
                row.update(mask_ms_mean=float(ft.mean()), mask_ms_p50=float(np.median(ft)),
                           mask_ms_p90=float(np.percentile(ft, 90)))
                row["records_valid"] = _count_valid(texts)
        row["overhead_pct"] = 100 * (1 - row["json_tok_s"] / row["free_tok_s"])
        print(f"batch {batch}: free {row['free_tok_s']:.1f} tok/s ({row['free_step_ms']:.2f} ms a step), full variant "
              f"{row['full_tok_s']:.1f} ({row['full_step_ms']:.2f} ms), json {row['json_tok_s']:.1f} "
              f"({row['json_step_ms']:.2f} ms): overhead {row['overhead_pct']:.1f}%; "
              f"host mask {row['mask_ms_mean']:.3f} ms a step (p50 {row['mask_ms_p50']:.3f}, "
              f"p90 {row['mask_ms_p90']:.3f}); complete records valid: "
              f"{row['records_valid'][0]} of {row['records_valid'][1]}", flush=True)
        results.append(row)
    print(f"recompiles after warm-up: {eng.runner.compiles_after_warmup}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


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
            except (ValueError, Exception):  # noqa: BLE001 - counted as invalid
                pass
    return good, total


if __name__ == "__main__":
    sys.exit(main())
