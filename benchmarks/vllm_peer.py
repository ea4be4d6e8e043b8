"""vLLM 0.26 as the peer for the offline protocols (BENCHMARKS.md): Protocol A-dense at a dense family's shape
with dummy weights, or any checkpoint directory (Protocol F's FP8 V3), batch B, random prompt ids, ignore EOS,
greedy and temperature 1.0. Run it with vLLM importable (its bundle, ../shared/peers/vllm_bundle.sh):

    python benchmarks/vllm_peer.py --dense llama-3.1-8b --batches 32
    python benchmarks/vllm_peer.py --dir /path/to/protocol-f-v3-fp8 --batches 32,128
    python benchmarks/vllm_peer.py --v4 14 --batches 32     # V4-Flash's width cut to 14 layers, as v4_offline.py
    python benchmarks/vllm_peer.py --preset deepseek-v2-lite --quantization fp8   # Protocol A, vLLM's online FP8

Prints start-up (load + compile + CUDA graphs) and, per batch and temperature, output tokens/s and how many
distinct tokens the batch produced (a handful means collapsed dummy weights: an invalid run). A quantized
checkpoint needs compressed-tensors and loguru beside the bundle (benchmarks/vllm_serve_deps.sh fetches them). The same
prompts (seeded ids) as benchmarks/dense.py and benchmarks/protocol_f.py draw. `--v4 N`: benchmarks/v4_offline.py's
model (HF's DeepseekV4Config cut to its first N layers, V4's release quantization_config: FP8 linears, FP4 experts)
with vLLM's dummy weights; vLLM's V4 keeps its cache in its fp8_ds_mla layout, so the KV cache is FP8 there.
`--preset NAME`: a model of configs/models with dummy weights (Protocol A's V2-Lite); `--quantization fp8` has vLLM
quantize its weights online, as `vllm serve --quantization fp8` (its own FP8 format: per-tensor scales).
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
sys.path.insert(0, HERE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--dense", help="a shape of benchmarks/dense.py (dummy weights)")
    src.add_argument("--dir", help="a checkpoint directory (its own weights and quantization_config)")
    src.add_argument("--v4", type=int, metavar="LAYERS", help="v4_offline.py's V4-Flash model cut to LAYERS layers")
    src.add_argument("--preset", help="a model of configs/models (dummy weights)")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="vLLM's online quantization of the weights")
    ap.add_argument("--batches", default="32")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    a = ap.parse_args(argv)
    os.environ.update(VLLM_USE_FLASHINFER_SAMPLER="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_CACHE_ROOT=tempfile.mkdtemp())
    if a.dense:
        from dense import SHAPES

        d, fmt = tempfile.mkdtemp(prefix=f"vllm-{a.dense}-"), "dummy"
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**SHAPES[a.dense], "torch_dtype": "bfloat16"}, f)
    elif a.v4:
        from v4_offline import base_config, cut, write_config

        cfg = dict(cut(base_config(None, False), a.v4, False), architectures=["DeepseekV4ForCausalLM"],
                   torch_dtype="bfloat16")
        d, fmt = write_config(cfg, tempfile.mkdtemp(), "v4"), "dummy"
    elif a.preset:
        d, fmt = tempfile.mkdtemp(prefix=f"vllm-{a.preset}-"), "dummy"
        with open(os.path.join(os.path.dirname(HERE), "configs", "models", f"{a.preset}.json")) as f:
            preset = json.load(f)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**preset, "torch_dtype": "bfloat16"}, f)
    else:
        d, fmt = a.dir, "auto"
    with open(os.path.join(d, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    batches = [int(b) for b in a.batches.split(",")]
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = LLM(model=d, load_format=fmt, skip_tokenizer_init=True, dtype="bfloat16", max_num_seqs=max(batches),
              max_model_len=a.prompt_len + a.output_len + 64, enable_prefix_caching=False,
              gpu_memory_utilization=a.gpu_memory_utilization, **({"kv_cache_dtype": "fp8"} if a.v4 else {}),
              **({"quantization": a.quantization} if a.quantization else {}))
    print(f"vLLM {__import__('vllm').__version__} ({fmt} weights{', ' + a.quantization if a.quantization else ''}, "
          f"{os.path.basename(d.rstrip('/'))}): start-up "
          f"{time.time() - t0:.1f}s", flush=True)
    rng = np.random.default_rng(1)
    hi = min(100000, vocab)

    def run(prompts, n, temp):
        torch.cuda.synchronize()
        t = time.time()
        out = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=temp, seed=0,
                                                   detokenize=False), use_tqdm=False)
        torch.cuda.synchronize()
        toks = [list(o.outputs[0].token_ids) for o in out]
        assert all(len(t) == n for t in toks)
        return time.time() - t, len({x for t in toks for x in t})

    print(f"{'batch':>6} {'temp':>5} {'tok/s':>9} {'seconds':>8} {'distinct':>9}")
    for b in batches:
        prompts = [TokensPrompt(prompt_token_ids=rng.integers(10, hi, a.prompt_len).tolist()) for _ in range(b)]
        run(prompts[:2], 8, 0.0)
        for temp in (0.0, 1.0):
            best = min(run(prompts, a.output_len, temp) for _ in range(2))
            print(f"{b:>6} {temp:>5} {b * a.output_len / best[0]:>9,.0f} {best[0]:>8.2f} {best[1]:>9}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
