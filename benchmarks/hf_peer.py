"""The HF transformers peer of Protocol A (BENCHMARKS.md), on the GPU machine's torch:
`model.generate` at the DeepSeek-V2-Lite shape with random weights at the same scale as ours
(linear weights U(+-0.05), norms U(0.9, 1.1)), batch 32, 512 random prompt ids, 256 new tokens,
greedy, ignore EOS; experts through transformers' grouped_mm (or eager) implementation.

    python benchmarks/hf_peer.py [--experts grouped_mm|eager] [--preset deepseek-v2-lite]
    python benchmarks/hf_peer.py --preset tiny-deepseek-v2 --batch 2 --prompt-len 16 --output-len 4   # CPU

Prints prefill time (one new token) and output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--experts", default="grouped_mm", choices=["grouped_mm", "eager"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    a = ap.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(os.path.join(os.path.dirname(HERE), "configs", "models", f"{a.preset}.json")) as f:
        d = json.load(f)
    config = AutoConfig.for_model(**d)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=a.experts)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.9, 1.1)
            elif "e_score_correction_bias" in name:
                p.uniform_(0.0, 0.1)
            else:
                p.uniform_(-0.05, 0.05)
    model.eval()
    ids = torch.randint(100, min(config.vocab_size, 100000), (a.batch, a.prompt_len), device=dev)
    mask = torch.ones_like(ids)

    def gen(n):
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.time()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.time() - t, out

    gen(2)  # warm-up
    t_prefill = min(gen(1)[0] for _ in range(2))
    dt, out = gen(a.output_len)
    assert out.shape[1] == a.prompt_len + a.output_len
    print(f"HF transformers {a.experts} on {dev}: prefill {a.batch}x{a.prompt_len} {t_prefill * 1e3:.0f} ms; "
          f"Protocol A greedy {dt:.2f}s -> {a.batch * a.output_len / dt:,.0f} output tok/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
