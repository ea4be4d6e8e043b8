"""DeepSeek-V4-Flash's width on one GPU, weights as released: Protocol A and long-context decode.

    python benchmarks/v4_offline.py [--layers N] [--contexts 8192,65536,262144] [--batch 4] [--steps 32]
                                    [--config CONFIG_JSON] [--skip-check]
    python benchmarks/v4_offline.py --smoke        # CPU: the tests' tiny V4, Pallas in interpret mode

The model: HF transformers' DeepseekV4Config (V4-Flash: hidden 4096, 256 routed experts top-6, 64 heads of 512,
CSA / HCA layers) or `--config`'s, cut to its first `--layers` layers (default: as many as fit the device with
room for the KV of `--batch` sequences at the longest context, computed from the bytes and printed), no MTP. Its
config.json carries V4's release `quantization_config` (FP8 e4m3 blocks of 128 x 128, `expert_dtype` "fp4"), so
`LLM(load_format="dummy")` draws the weights in the release's formats on the device (weights/release_random.py):
routed experts FP4 packed (Fp4Weight), attention and shared-expert linears FP8 (Fp8Weight), as a real release
loads; `--attn-impl pallas --moe-impl pallas` run kernels/v4_sparse_attention.py, V3.2's indexer kernel and
kernels/moe_gmm_quant.py's FP4 grouped GEMM on them.

1. Correctness first, in a process of its own (the script stops if it fails): the first `--check-layers` layers
   (HCA, CSA, hash-routed and scored MoE layers at V4-Flash's order) through the engine with the benchmark's
   impls, greedy, against the same weights through attn_impl "reference" / moe_impl "dense" (every expert
   dequantized; `--check-moe-impl`), in `--check-dtype`. The tokens must agree up to where a prompt's two
   continuations part, and there only at a near tie: each engine's token among the other's two most likely (the
   FP8 linears round their activations to e4m3, W8A8, which the reference does not, so random weights' near ties
   may fall either way); a first token that differs, or a token outside the other's top two, fails.
2. Protocol A (BENCHMARKS.md, as benchmarks/offline.py): batch 32, 512 random prompt ids, 256 out, ignore EOS,
   greedy: output tok/s, the batch's prefill time, decode ms a step (the run less its prefill), start-up time.
3. Long context: for each of `--contexts`, `--batch` random prompts of that length prefilled (chunks of
   `--max-num-batched-tokens`; the prefill time printed), then the same prompts again (their pages from the prefix
   cache) decoding `--steps` tokens: decode ms a step and tok/s over the steps where every sequence decodes. The
   KV cache's device bytes per token of context (config_v4.v4_cache_bytes_per_token) beside V3's MLA
   (61 layers x 576 values x 2 bytes).
Each phase prints a timestamp (seconds since start).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# as benchmarks/gpu.sh runs every benchmark: XLA's allocator may take 92% of the device (JAX's default is 75%)
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import numpy as np  # noqa: E402

from deepinfer_jax.types import RequestOutputKind, SamplingParams  # noqa: E402

T0 = time.time()
MLA_V3_BYTES = 61 * 576 * 2  # bytes per token of V3's latent cache (kv_lora_rank 512 + rope 64, 61 layers, bf16)
RELEASE = {"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                   "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
           "expert_dtype": "fp4"}


def stamp(text: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {text}", flush=True)


def base_config(path: str | None, smoke: bool) -> dict:
    """The full model's deepseek_v4 config: the tests' tiny V4 (smoke), `path`'s, or HF's DeepseekV4Config."""
    from offload_load import v4_dict

    return dict(v4_dict(path or "default", sys.maxsize, smoke), model_type="deepseek_v4")


def cut(d: dict, layers: int, smoke: bool) -> dict:
    """`d` cut to its first `layers` layers, no MTP, as a release config (FP8 blocks of 8 x 12 in the smoke run:
    the tiny model's odd sizes leave partial blocks at the edges, as a test release does)."""
    from offload_load import v4_cut

    d = dict(v4_cut(d, layers), model_type="deepseek_v4", **json.loads(json.dumps(RELEASE)))
    if smoke:
        d["quantization_config"]["weight_block_size"] = [8, 12]
    return d


def write_config(d: dict, root: str, name: str) -> str:
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f)
    return path


def weight_bytes(d: dict) -> tuple[int, list[int]]:
    """(bytes outside the layers, each layer's bytes) of the release-format params of config `d` (bf16 floats): V4's
    list of layers, or the MLA family's segments of stacked layers (a segment's bytes shared by its layers)."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.weights.release_random import pending_release_params, release_quant

    cfg = ModelConfig.from_hf_dict(d)
    abstract = pending_release_params(cfg, release_quant(d, cfg), jnp.bfloat16).abstract

    def nbytes(tree):
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    if "layers" in abstract:
        per_layer = [nbytes(lp) for lp in abstract["layers"]]
    else:
        per_layer = [nbytes(seg) // n for seg in abstract["segments"]
                     for n in [jax.tree.leaves(seg)[0].shape[0]] for _ in range(n)]
    return nbytes(abstract) - sum(per_layer), per_layer


def kv_bytes(d: dict, seqs: int, context: int) -> int:
    """Device bytes of the per-group cache for `seqs` sequences of `context` tokens (bf16)."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.config_v4 import v4_cache_bytes_per_token, v4_cache_fixed_bytes

    v4 = ModelConfig.from_hf_dict(d).v4
    return int(seqs * (context * v4_cache_bytes_per_token(v4)["total"] + v4_cache_fixed_bytes(v4)))


def layers_that_fit(full: dict, device_bytes: float, batch: int, context: int, headroom: float, cut=cut,
                    kv_bytes=kv_bytes) -> int:
    """The most layers (of `full`'s order) whose weights, plus the KV of `batch` sequences at `context` and
    `headroom` bytes for the steps' activations, fit in `device_bytes`; `cut(d, n, smoke)` and `kv_bytes(d, seqs,
    context)`: the model's (V4's by default)."""
    outside, per_layer = weight_bytes(cut(full, full["num_hidden_layers"], False))
    n = 0
    while n < len(per_layer):
        need = outside + sum(per_layer[: n + 1]) + kv_bytes(cut(full, n + 1, False), batch, context) + headroom
        if need > device_bytes:
            break
        n += 1
    return n


def expert_kernel_takes(d: dict, tokens: int, kind: str = "fp4") -> bool:
    """Whether kernels/moe_gmm_quant.py takes `kind` ("fp4", or "fp8" in `d`'s blocks) experts of `d`'s shape at a
    step of `tokens` tokens (where not, the MoE dequantizes the layer's experts for XLA's GEMMs instead)."""
    from deepinfer_jax.kernels.fp4 import FP4_GROUP
    from deepinfer_jax.kernels.moe_gmm_quant import WeightFormat, supported
    from deepinfer_jax.models.quant import fp8_kernel_act

    if kind == "fp4":
        f = WeightFormat("fp4", FP4_GROUP, layout="nk")
    else:
        bn, bk = d["quantization_config"]["weight_block_size"]
        f = WeightFormat("fp8", group=bk, block_n=bn, act=fp8_kernel_act(tokens, experts=True), layout="nk")
    return supported(f, f, d["hidden_size"], d["moe_intermediate_size"], tokens * d["num_experts_per_tok"])


def drive(eng, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    """Run `prompts` greedily to `max_tokens` each through the engine's step loop: the time until every request
    has its first token, the steps and time from then until the first request finishes (every sequence decoding),
    the whole run's time, the tokens, the prompt tokens found in the prefix cache."""
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                       output_kind=RequestOutputKind.DELTA))
    toks = {f"{tag}{i}": [] for i in range(len(prompts))}
    cached, t_first, t_fin, steps_between = 0, None, None, 0
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter()
        if t_first is not None and t_fin is None:
            steps_between += 1
        for o in outs:
            if not toks[o.request_id]:
                cached += o.num_cached_tokens
            toks[o.request_id].extend(o.outputs[0].token_ids)
            if o.finished and t_fin is None:
                t_fin = now
        if t_first is None and all(toks.values()):
            t_first = now
    end = time.perf_counter()
    return {"first_s": t_first - t, "decode_s": (t_fin or end) - t_first, "decode_steps": steps_between,
            "total_s": end - t, "tokens": [toks[f"{tag}{i}"] for i in range(len(prompts))], "cached": cached}


def check(d: dict, root: str, impls: dict, reference_moe: str, dtype: str, smoke: bool,
          lengths: tuple = (300, 170), max_len: int = 512) -> None:
    """Section 1 of the docstring: greedy tokens with `impls` == reference / `reference_moe` on the same weights,
    prompts of `lengths` tokens in an engine of `max_len` (the smoke run's: 29 and 41 tokens, 64)."""
    import gc

    from deepinfer_jax import LLM

    path = write_config(d, root, "check")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, d["vocab_size"], n).tolist() for n in ((29, 41) if smoke else lengths)]
    max_len = 64 if smoke else max_len
    n_out = 8
    got, top2 = {}, {}
    ps = 4 if smoke else 64
    for name, kw in (("benchmark", impls), ("reference", dict(attn_impl="reference", moe_impl=reference_moe))):
        llm = LLM(path, dtype=dtype, load_format="dummy", skip_tokenizer_init=True, max_model_len=max_len,
                  max_num_seqs=2, max_num_batched_tokens=512 if not smoke else 13, page_size=ps,
                  num_pages=2 * (max_len // ps) + 8,
                  enable_prefix_caching=False, progress=False, warmup_runs=1, seed=0,
                  token_buckets=(2, 13) if smoke else (2, 512), **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True, logprobs=2),
                            use_tqdm=False)
        got[name] = [o.outputs[0].token_ids for o in outs]
        top2[name] = [o.outputs[0].logprobs for o in outs]
        del llm, outs
        gc.collect()  # the first engine's weights and pools off the device before the second's
        stamp(f"check: {name} engine ({kw['attn_impl']} / {kw['moe_impl']}) generated {got[name]}")
    same, total, problems = 0, 0, []
    for j, (b, r) in enumerate(zip(got["benchmark"], got["reference"])):
        total += len(r)
        i = next((i for i, (x, y) in enumerate(zip(b, r)) if x != y), len(r))
        same += i
        if i == len(r):
            continue
        lb, lr = top2["benchmark"][j][i], top2["reference"][j][i]
        near = b[i] in lr and r[i] in lb
        gap = lr[r[i]].logprob - lr[b[i]].logprob if b[i] in lr else float("inf")
        print(f"check: prompt {j} parts at token {i}: {b[i]} against the reference's {r[i]}, "
              f"{'a near tie' if near else 'NOT a near tie'} (reference log-prob gap {gap:.4f})", flush=True)
        if i == 0 or not near:
            problems.append(j)
    n, k = d["num_hidden_layers"], min(d["num_hidden_layers"], d.get("first_k_dense_replace") or 0)
    v4_kinds = set(d.get("layer_types") or ()) | set(d.get("mlp_layer_types") or ())
    kinds = ", ".join(sorted(v4_kinds)) if d["model_type"] == "deepseek_v4" else f"{k} dense, {n - k} MoE"
    print(f"check: {same}/{total} greedy tokens agree before the continuations part ({n} layers: {kinds}; {dtype}; "
          f"prompts of {[len(p) for p in prompts]})", flush=True)
    if problems:
        sys.exit("check FAILED: the benchmark's kernels do not give the reference's tokens; no timings")


def protocol_a(eng, vocab: int, batch: int, prompt_len: int, output_len: int) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(min(100, vocab // 2), min(vocab, 100000), prompt_len).tolist() for _ in range(batch)]
    drive(eng, prompts, 4, "warm")  # every path once more after warm-up
    prefill = min(drive(eng, prompts, 1, f"p{k}-")["total_s"] for k in range(2))
    runs = [drive(eng, prompts, output_len, f"a{k}-") for k in range(2)]
    best = min(r["total_s"] for r in runs)
    distinct = len({t for r in runs[:1] for x in r["tokens"] for t in x[-64:]})
    step_ms = (best - prefill) / max(1, output_len - 1) * 1e3
    stamp(f"Protocol A: batch {batch} x {prompt_len} in, {output_len} out, greedy: {best:.2f}s -> "
          f"{batch * output_len / best:,.0f} output tok/s (runs {', '.join('%.2f' % r['total_s'] for r in runs)}); "
          f"prefill {prefill * 1e3:.0f} ms; decode step {step_ms:.2f} ms; distinct tokens (last 64 steps) {distinct}")


def long_context(eng, d: dict, contexts: list[int], batch: int, steps: int) -> list[dict]:
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.config_v4 import v4_cache_bytes_per_token, v4_cache_fixed_bytes

    v4 = ModelConfig.from_hf_dict(d).v4
    per = v4_cache_bytes_per_token(v4)
    print(f"KV cache bytes per token of context ({v4.num_hidden_layers} layers, bf16): {per['total']:,.1f} "
          f"(CSA rows {per['csa_rows']:,.1f}, HCA rows {per['hca_rows']:,.1f}, "
          f"indexer keys {per['indexer_keys']:,.1f}) "
          f"+ {v4_cache_fixed_bytes(v4) / 2**20:,.2f} MiB a sequence (windows); per layer "
          f"{per['total'] / v4.num_hidden_layers:,.1f} against V3's MLA {MLA_V3_BYTES / 61:,.0f} "
          f"(61 layers: {MLA_V3_BYTES:,} a token)", flush=True)
    return context_rows(eng, d["vocab_size"], contexts, batch, steps, "KV GiB (V4 / V3 MLA)",
                        lambda ctx: f"{kv_bytes(d, batch, ctx) / 2**30:.2f} / {batch * ctx * MLA_V3_BYTES / 2**30:.2f}")


def context_rows(eng, vocab: int, contexts: list[int], batch: int, steps: int, kv_title: str, kv_text) -> list[dict]:
    """Section 3 of the docstring's table, a row a context (`kv_text(context)` its last column): the rows' figures,
    {"context", "prefill_s", "decode_ms", "decode_tok_s"} (an "error" instead where a context failed)."""
    print(f"{'context':>9} | {'batch':>5} | {'prefill s':>9} {'prefill tok/s':>13} | {'decode ms/step':>14} "
          f"{'decode tok/s':>12} | {'cached':>7} | {kv_title}", flush=True)
    rng, rows = np.random.default_rng(2), []
    for ctx in contexts:
        prompts = [rng.integers(min(100, vocab // 2), min(vocab, 100000), ctx).tolist() for _ in range(batch)]
        try:
            pre = drive(eng, prompts, 1, f"c{ctx}-p")
            dec = drive(eng, prompts, steps + 1, f"c{ctx}-d")
        except Exception as e:  # noqa: BLE001  (out of memory at this context: report it, go on)
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
            print(f"{ctx:>9,} | {batch:>5} | {error}", flush=True)
            rows.append({"context": ctx, "error": error})
            continue
        ms = dec["decode_s"] / max(1, dec["decode_steps"]) * 1e3
        print(f"{ctx:>9,} | {batch:>5} | {pre['total_s']:9.2f} {batch * ctx / pre['total_s']:13,.0f} | {ms:14.2f} "
              f"{batch * 1e3 / ms:12,.1f} | {dec['cached'] / (batch * ctx):6.0%} | {kv_text(ctx)}", flush=True)
        stamp(f"context {ctx:,} done ({dec['decode_steps']} decode steps timed, second pass's prefill "
              f"{dec['first_s']:.2f}s)")
        rows.append({"context": ctx, "prefill_s": pre["total_s"], "decode_ms": ms, "decode_tok_s": batch * 1e3 / ms})
    return rows


def add_run_args(ap: argparse.ArgumentParser, contexts: str, check_layers: int, model: str) -> None:
    """The arguments of a whole-model run (this script's and benchmarks/v32_offline.py's)."""
    ap.add_argument("--config", default=None, help=f"a {model} config.json (default: HF's config class)")
    ap.add_argument("--layers", type=int, default=None, help="its first this many layers (default: what fits)")
    ap.add_argument("--contexts", default=contexts)
    ap.add_argument("--batch", type=int, default=4, help="sequences at each long context")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed at each long context")
    ap.add_argument("--pa-batch", type=int, default=32)
    ap.add_argument("--pa-prompt-len", type=int, default=512)
    ap.add_argument("--pa-output-len", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384, help="the prefill chunk")
    ap.add_argument("--attn-impl", default="pallas", choices=["pallas", "pallas_interpret", "reference"])
    ap.add_argument("--moe-impl", default="pallas", choices=["pallas", "pallas_interpret", "ragged", "dense"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--check-layers", type=int, default=check_layers, help="layers of the correctness check's model")
    ap.add_argument("--check-dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--check-moe-impl", default="dense", choices=["dense", "ragged"],
                    help="the check's reference experts: every expert dequantized (dense) or the routed copies")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--headroom-gib", type=float, default=16.0,
                    help="device memory left for the steps' temporaries: the default --layers leave it, and the "
                         "engine's gpu_memory_utilization is lowered by it (the engine fills the rest with KV cache)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--smoke", action="store_true", help=f"CPU: the tests' tiny {model}, interpret kernels, tiny sizes")


def run_sizes(a: argparse.Namespace) -> list[int]:
    """The contexts of `a`; with --smoke, the tiny model's sizes set on `a` and its kernels in interpret mode (an impl
    "pallas" runs as "pallas_interpret", the others as named)."""
    contexts = [int(c) for c in a.contexts.split(",") if c.strip()]
    if a.smoke:
        contexts, a.batch, a.steps = [24, 40], 2, 4  # within the tiny V4's max_position_embeddings of 64
        a.pa_batch, a.pa_prompt_len, a.pa_output_len, a.max_num_batched_tokens = 2, 16, 8, 32
        a.attn_impl, a.moe_impl = ("pallas_interpret" if i == "pallas" else i for i in (a.attn_impl, a.moe_impl))
        a.check_layers, a.layers = 3, a.layers or 3
    return contexts


def device_limit():
    """(the device, the bytes XLA may use of it, whether measured: 80 GiB is assumed where it does not say)."""
    import jax

    from deepinfer_jax.runner.device_memory import device_memory

    dev = jax.devices()[0]
    mem = device_memory(dev)
    return dev, (mem.limit if mem is not None else 80 * 2**30), mem is not None


def start_engine(path: str, a: argparse.Namespace, impls: dict, max_len: int, seqs: int, chunk: int,
                 buckets: list[int]):
    """A timed engine on the model directory `path` (`a`: a run's arguments) for `seqs` sequences of up to `max_len`
    tokens, prefill chunks of `chunk`, step programs at `buckets` tokens; its start-up stamped."""
    from deepinfer_jax import LLM

    t = time.time()
    limit = device_limit()[1]  # the KV cache takes the allocator's limit x utilization less the weights
    util = max(0.05, a.gpu_memory_utilization - (0 if a.smoke else a.headroom_gib * 2**30 / limit))
    llm = LLM(path, dtype=a.dtype, load_format="dummy", skip_tokenizer_init=True,
              max_model_len=max_len, max_num_seqs=seqs,
              max_num_batched_tokens=chunk, page_size=4 if a.smoke else 64,
              gpu_memory_utilization=util, progress=False, token_buckets=buckets,
              **({"warmup_runs": 1} if a.smoke else {}), **impls)
    eng = llm.engine
    stamp(f"start-up {time.time() - t:.1f}s (weights drawn on the device + {eng.num_warmup_compiles} step "
          f"programs compiled; token buckets {buckets}); KV cache {eng.kv_cache_report} (gpu_memory_utilization "
          f"{util:.3f}: {a.headroom_gib:g} GiB left for the steps' temporaries)")
    return llm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_run_args(ap, "8192,65536,262144", 4, "deepseek_v4")
    ap.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)  # the check's own process
    a = ap.parse_args(argv)
    contexts = run_sizes(a)
    impls = dict(attn_impl=a.attn_impl, moe_impl=a.moe_impl)
    from deepinfer_jax.runner.compile_cache import enable_compilation_cache

    full = base_config(a.config, a.smoke)
    if a.check_only:
        enable_compilation_cache("default")
        with tempfile.TemporaryDirectory() as root:
            check(cut(full, a.check_layers, a.smoke), root, impls, a.check_moe_impl, a.check_dtype, a.smoke)
        return 0
    if not a.skip_check:  # in a process of its own, before this one takes the device: its memory is all returned
        rc = subprocess.run([sys.executable, os.path.abspath(__file__),
                             *(sys.argv[1:] if argv is None else argv), "--check-only"]).returncode
        if rc:
            sys.exit(f"the check failed (exit status {rc}): no timings")
        stamp("check passed")

    import jax

    enable_compilation_cache("default")
    dev, limit, measured = device_limit()
    if a.layers is None:
        a.layers = layers_that_fit(full, limit * a.gpu_memory_utilization, a.batch, max(contexts) + a.steps + 1,
                                   a.headroom_gib * 2**30)
        if a.layers < 1:
            sys.exit(f"not one layer fits {limit / 2**30:.1f} GiB with the KV of {a.batch} x {max(contexts):,} tokens")
    d = cut(full, a.layers, a.smoke)
    outside, per_layer = weight_bytes(d)
    stamp(f"device {dev.device_kind} ({jax.default_backend()}, {limit / 2**30:.1f} GiB"
          f"{'' if measured else ' assumed'}, XLA_PYTHON_CLIENT_MEM_FRACTION "
          f"{os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION']}); model: hidden "
          f"{d['hidden_size']}, {d['n_routed_experts']} experts top-{d['num_experts_per_tok']}, FP4 experts, FP8 "
          f"linears; {a.layers} of {full['num_hidden_layers']} layers ({', '.join(d['layer_types'])}); weights "
          f"{(outside + sum(per_layer)) / 2**30:.2f} GiB ({sum(per_layer) / len(per_layer) / 2**30:.3f} a layer, "
          f"{outside / 2**30:.2f} outside); attn {a.attn_impl}, moe {a.moe_impl}, {a.dtype}")
    if a.moe_impl.startswith("pallas"):
        takes = {n: expert_kernel_takes(d, n) for n in sorted({a.batch, a.pa_batch, a.max_num_batched_tokens})}
        print(f"FP4 expert kernel takes the steps of {', '.join(f'{n} tokens: {t}' for n, t in takes.items())}",
              flush=True)
    with tempfile.TemporaryDirectory() as root:
        max_len = max(max(contexts) + a.steps + 1, a.pa_prompt_len + a.pa_output_len)
        llm = start_engine(write_config(d, root, "model"), a, impls, max_len, max(a.batch, a.pa_batch),
                           a.max_num_batched_tokens, sorted({a.batch, a.pa_batch, a.max_num_batched_tokens}))
        eng = llm.engine
        protocol_a(eng, d["vocab_size"], a.pa_batch, a.pa_prompt_len, a.pa_output_len)
        long_context(eng, d, contexts, a.batch, a.steps)
    stamp(f"done; compiles after warm-up: {eng.runner.compiles_after_warmup}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
