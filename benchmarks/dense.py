"""Protocol A-dense (issue 52): offline generation on the dense family at the Qwen2.5-7B shape (DeepSeek-R1-Distill-
Qwen-7B) and the Llama-3.1-8B shape, random weights, batch 32, 512 random prompt ids, 256 output tokens, ignore
EOS, greedy and temperature 1.0, steps of up to 16,384 tokens (vLLM's LLM default on an 80 GB GPU, the step budget
vllm_peer.py's vLLM runs under). Correctness first: the Pallas GQA attention against the pure-JAX reference at each
shape's heads (a decode step, kernels/gqa_attention.py, and a ragged prefill step, kernels/gqa_prefill.py; bf16),
then the timings.

    python benchmarks/dense.py                              # both shapes, on a GPU
    python benchmarks/dense.py --shapes llama-3.1-8b --batch 8 --prompt-len 128 --output-len 32
    python benchmarks/dense.py --shapes llama-3.1-8b --layers 1 --batch 2 --prompt-len 16 --output-len 4 \
        --max-num-batched-tokens 64                         # CPU smoke

Prints per shape: the kernel's largest error against the reference; start-up, split into the weights' load (on its
own thread, beside warm-up), warm-up's tracing and lowering, its wait for the weights and all of warm-up, and the
number of step programs; the batch's prefill (the same prompts with 1 output token); output tokens/s for greedy
and temperature 1, and the decode step (the run less its prefill, over the output tokens after the first) beside
its weight-read floor (weight bytes / HBM bandwidth). Each timing is the better of two runs. vLLM's figures on the
same machine go beside these in benchmarks/RESULTS.md. `--decode-shared-forward`, `--no-decode-projection-kernel`,
`--unroll-max-tokens`, `--prefill-layers`, `--max-num-batched-tokens`: the RunnerConfig / scheduler settings to
compare start-up and steps under.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

HBM_BYTES_PER_S = 3.35e12  # H100 SXM datasheet; pass --hbm for another card (H200: 4.8e12)

SHAPES = {
    "qwen2.5-7b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False, bos_token_id=151643,
                       eos_token_id=151643),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, hidden_act="silu", bos_token_id=128000, eos_token_id=128001,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


def check_kernel(cfg, page_size: int, context: int) -> float:
    """Largest |kernel - reference| over a decode step (32 tokens at `context`: kernels/gqa_attention.py) and a
    prefill step (2 prompts of `context` tokens: kernels/gqa_prefill.py), bf16 cache of 2 layers."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.gqa_attention import paged_gqa_attention
    from deepinfer_jax.kernels.gqa_prefill import ragged_gqa_attention
    from deepinfer_jax.kernels.gqa_reference import paged_gqa_attention_reference

    H, KVH, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pages_per_seq = context // page_size + 1
    rng = np.random.default_rng(0)
    worst = 0.0
    for seqs, per_seq in ((32, 1), (2, context)):
        num_pages = seqs * pages_per_seq + 1
        cache = jnp.asarray(rng.standard_normal((2, num_pages, page_size, 2, KVH, hd)), jnp.bfloat16)
        table = jnp.asarray(1 + rng.permutation(seqs * pages_per_seq).reshape(seqs, pages_per_seq), jnp.int32)
        seq = np.repeat(np.arange(seqs), per_seq)
        pos = np.concatenate([np.arange(context - per_seq, context)] * seqs)
        q = jnp.asarray(rng.standard_normal((len(seq), H, hd)), jnp.bfloat16)
        args = (q, cache, 1, jnp.asarray(seq, jnp.int32), jnp.asarray(pos, jnp.int32), table, hd ** -0.5)
        kernel = paged_gqa_attention if per_seq == 1 else ragged_gqa_attention
        out = jax.block_until_ready(kernel(*args, interpret=jax.default_backend() != "gpu"))
        ref = paged_gqa_attention_reference(*args)
        worst = max(worst, float(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)).max()))
    return worst


def weight_bytes(cfg) -> int:
    import jax

    from deepinfer_jax.models.params import is_spec
    from deepinfer_jax.models.registry import param_specs

    leaves = jax.tree.flatten_with_path(param_specs(cfg), is_leaf=is_spec)[0]
    return sum(2 * int(np.prod(s.shape)) for p, s in leaves if jax.tree_util.keystr(p) != "['embed']")


def run_shape(name: str, args) -> dict:
    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.config import ModelConfig

    d = tempfile.mkdtemp(prefix=f"dense-{name}-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**SHAPES[name], **({"num_hidden_layers": args.layers} if args.layers else {})}, f)
    cfg = ModelConfig.from_model_dir(d)
    err = check_kernel(cfg, args.page_size, args.prompt_len)
    print(f"[{name}] Pallas GQA attention vs reference: max |error| {err:.3g} (bf16)", flush=True)
    if err > 0.05:
        raise SystemExit(f"[{name}] the kernel disagrees with the reference ({err:.3g}): no timing")
    t0 = time.time()
    llm = LLM(d, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=args.batch,
              max_model_len=args.prompt_len + args.output_len + 16, page_size=args.page_size, progress=False,
              enable_prefix_caching=False,  # as vllm_peer.py's vLLM: every run prefills its prompts whole
              max_num_batched_tokens=args.max_num_batched_tokens or None, unroll_max_tokens=args.unroll_max_tokens,
              prefill_layers=args.prefill_layers, decode_shared_forward=args.decode_shared_forward,
              decode_projection_kernel=args.decode_projection_kernel,
              compilation_cache_dir=None if args.compilation_cache_dir == "none" else args.compilation_cache_dir)
    start = time.time() - t0
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(10, cfg.vocab_size, args.prompt_len).tolist()}
               for _ in range(args.batch)]
    row = {"shape": name, "startup_s": round(start, 1)}
    split = llm.engine.runner.startup_seconds  # runner/model_runner.py: where warm-up's seconds went
    for key in ("weights", "lowered", "weights_waited", "warmup"):
        row[f"{key}_s"] = None if split.get(key) is None else round(split[key], 1)
    row["programs"] = llm.engine.num_warmup_compiles
    row["kernel_err"] = err
    floor_ms = 1e3 * weight_bytes(cfg) / args.hbm
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # nothing left to compile

    def best_of_two(params):  # as vllm_peer.py times vLLM: a first run pays one-off costs
        dt = float("inf")
        for _ in range(2):
            t = time.time()
            outs = llm.generate(prompts, params)
            dt = min(dt, time.time() - t)
        return dt, outs

    prefill = best_of_two(SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0]
    row["prefill_ms"] = round(1e3 * prefill, 1)
    for label, temp in (("greedy", 0.0), ("temp1", 1.0)):
        dt, outs = best_of_two(SamplingParams(temperature=temp, max_tokens=args.output_len, ignore_eos=True, seed=0))
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        row[f"{label}_tok_s"] = round(n / dt, 1)
        row[f"{label}_distinct_tokens"] = len({t for o in outs for t in o.outputs[0].token_ids})
        step = 1e3 * (dt - prefill) / max(1, args.output_len - 1)  # decode only: the run less its prefill
        row[f"{label}_decode_ms"] = round(step, 2)
        row[f"{label}_vs_floor"] = round(step / floor_ms, 2)
    assert llm.engine.runner.compiles_after_warmup == 0, "a step compiled after warm-up: the timings include it"
    row["weight_read_floor_ms"] = round(floor_ms, 2)
    if args.trace:
        trace_decode(llm, prompts, os.path.join(args.trace, name), args.trace_steps)
    if args.trace_prefill:
        trace_prefill(llm, prompts, os.path.join(args.trace_prefill, name))
    return row


def trace_prefill(llm, prompts, trace_dir: str) -> None:
    """Trace the batch's prefill (its steps until every sequence has its first token) and print the device's time
    by category and kernel a step, as `trace_decode` does for decode steps."""
    import jax

    from deepinfer_jax import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"trace-prefill-{i}", p["prompt_token_ids"], sp)
    steps = 0
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    jax.profiler.stop_trace()
    print_trace(trace_dir, steps, f"prefill trace, {len(prompts)} prompts in {steps} steps")


def print_trace(trace_dir: str, steps: int, label: str) -> None:
    """The device's busy time a step and its GPU time by category and kernel (benchmarks/trace_tools.py)."""
    from benchmarks.trace_tools import busy_union, first_gpu, gpu_kernels, summarize

    kern = gpu_kernels(trace_dir) or []
    if not kern:
        print(f"no GPU kernels in the trace under {trace_dir}")
        return
    one = first_gpu(kern)
    window = one[-1]["ts"] + one[-1].get("dur", 0.0) - one[0]["ts"]
    print(f"{label}: {window / steps / 1e3:.2f} ms a step on the device's clock, "
          f"busy {busy_union(one) / steps / 1e3:.2f} ms")
    summarize(kern, steps, top=25)


def trace_decode(llm, prompts, trace_dir: str, steps: int) -> None:
    """Trace `steps` greedy decode steps of the whole batch (after its prefill) and print the device's busy and idle
    time a step and its GPU time by category and kernel (benchmarks/trace_tools.py)."""
    import jax

    from deepinfer_jax import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"trace-{i}", p["prompt_token_ids"], sp)
    while any(not r.output_token_ids for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # the prefill, until every sequence decodes
    eng.step()
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for _ in range(steps):
        eng.step()
    jax.profiler.stop_trace()
    while eng.has_unfinished_requests():
        eng.step()
    print_trace(trace_dir, steps, f"decode trace, {steps} steps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--hbm", type=float, default=HBM_BYTES_PER_S, help="the card's HBM bytes/s for the floor")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384,
                    help="the scheduler's step budget: vLLM's LLM default on an 80 GB GPU, which vllm_peer.py runs "
                         "under, as offline.py's Protocol A does (0: LLM's own default, 2048 at this batch)")
    ap.add_argument("--unroll-max-tokens", type=int, default=None,
                    help="RunnerConfig.unroll_max_tokens (default: 256 on a GPU)")
    ap.add_argument("--prefill-layers", choices=["scan", "indexed"], default=None,
                    help="RunnerConfig.prefill_layers: how steps above unroll_max_tokens run their layers")
    ap.add_argument("--layers", type=int, default=0, help="cut the shape to this many layers (a smoke run on a CPU)")
    ap.add_argument("--compilation-cache-dir", default="default",
                    help="LLM's compilation_cache_dir ('none': off, every start cold; 'default': a later start on the "
                         "same machine loads its programs)")
    ap.add_argument("--decode-projection-kernel", action=argparse.BooleanOptionalAction, default=True,
                    help="RunnerConfig.decode_projection_kernel: decode steps read the projections in place")
    ap.add_argument("--decode-shared-forward", action="store_true",
                    help="RunnerConfig.decode_shared_forward: decode buckets' variants share one compiled forward")
    ap.add_argument("--trace", default="", help="then trace greedy decode steps into this folder and print where "
                                                "the device's time goes (GPU)")
    ap.add_argument("--trace-steps", type=int, default=16)
    ap.add_argument("--trace-prefill", default="", help="then trace the batch's prefill into this folder and print "
                    "where the device's time went")
    args = ap.parse_args()
    rows = [run_shape(s, args) for s in args.shapes]
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))


if __name__ == "__main__":
    main()
