"""Protocol F (issue 45): DeepSeek-V3 at full width with FP8 block-scaled weights against the same model in bf16.

    python benchmarks/protocol_f.py [--dir /tmp/v3-fp8] [--moe-layers 2] [--batches 32,128]

Shape: V3's config (hidden 7168, MLA with q_lora 1536, 256 routed experts top-8 + 1 shared, 128 x 128 FP8
blocks) with 1 dense layer and --moe-layers MoE layers, as many as fit one GPU in bf16 with room for the KV cache
(2 on an 80 GB H100: a bf16 MoE layer is 22.5 GB; 4 on an H200). Steps:

1. Writes an FP8 checkpoint with random weights to --dir (skipped when its config.json is there): HF's tensor
   names and [out, in] e4m3 weights with fp32 `weight_scale_inv` blocks, bf16 norms / router / embeddings, a
   config.json with V3's quantization_config, so vLLM can load the same directory. Weights are draws of a
   normal at std 0.02 (dequantized), the router's at a scale that spreads tokens over experts.
2. FP8 (the checkpoint's own format, `--quantization auto`): a greedy check run (8 prompts, 8 tokens), then
   Protocol A's loop at each batch: 512 random prompt ids in, 256 out (ignore EOS), greedy; output tok/s, and the
   routing realism: distinct experts per MoE layer per decode step.
3. bf16 (`--quantization none`: the same checkpoint dequantized at load, the reference arithmetic): the same
   greedy check first, its agreement with the FP8 tokens printed (W8A8 rounds activations, so near ties may
   flip; most positions should agree), then the same timing. Last, FP8 / bf16 per batch (issue 45's target:
   1.6x at decode).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

BLOCK = 128
STD = 0.02


def v3_config(moe_layers: int) -> dict:
    with open(os.path.join(os.path.dirname(HERE), "configs", "models", "deepseek-v3.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=1 + moe_layers, first_k_dense_replace=1, num_nextn_predict_layers=0)
    return cfg


class _Writer:
    """One safetensors file written tensor by tensor (header first, sized from the planned tensors)."""

    DT = {"F8_E4M3": 1, "F32": 4, "BF16": 2}

    def __init__(self, path: str, plan: list[tuple[str, str, tuple]]):
        header, off = {}, 0
        for name, dt, shape in plan:
            n = int(np.prod(shape)) * self.DT[dt]
            header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        self.f = open(path, "wb")
        self.f.write(len(raw).to_bytes(8, "little") + raw)
        self.plan = iter(plan)

    def write(self, name: str, a: np.ndarray):
        expect, _, shape = next(self.plan)
        assert expect == name and tuple(a.shape) == tuple(shape), (name, a.shape, shape)
        self.f.write(np.ascontiguousarray(a).tobytes())

    def close(self):
        self.f.close()


def _tensors(cfg: dict, layer: int) -> list[tuple[str, tuple, bool]]:
    """(name, [out, in] shape, fp8) of one layer's tensors in HF's names."""
    D, H, R, dr = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    dn, dv, Rq = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["q_lora_rank"]
    p = f"model.layers.{layer}."
    out = [(p + "input_layernorm.weight", (D,), False), (p + "post_attention_layernorm.weight", (D,), False),
           (p + "self_attn.q_a_proj.weight", (Rq, D), True), (p + "self_attn.q_a_layernorm.weight", (Rq,), False),
           (p + "self_attn.q_b_proj.weight", (H * (dn + dr), Rq), True),
           (p + "self_attn.kv_a_proj_with_mqa.weight", (R + dr, D), True),
           (p + "self_attn.kv_a_layernorm.weight", (R,), False),
           (p + "self_attn.kv_b_proj.weight", (H * (dn + dv), R), True),
           (p + "self_attn.o_proj.weight", (D, H * dv), True)]

    def mlp(prefix, inter):
        return [(prefix + "gate_proj.weight", (inter, D), True), (prefix + "up_proj.weight", (inter, D), True),
                (prefix + "down_proj.weight", (D, inter), True)]

    if layer < cfg["first_k_dense_replace"]:
        return out + mlp(p + "mlp.", cfg["intermediate_size"])
    E, I = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    out += [(p + "mlp.gate.weight", (E, D), False), (p + "mlp.gate.e_score_correction_bias", (E,), False)]
    out += mlp(p + "mlp.shared_experts.", I * cfg["n_shared_experts"])
    for e in range(E):
        out += mlp(p + f"mlp.experts.{e}.", I)
    return out


def write_checkpoint(d: str, cfg: dict, seed: int = 0) -> None:
    """Random FP8 weights (module docstring). Each e4m3 tensor is a window of one shared pool of e4m3 draws (a
    standard normal x 112, amax ~ 448 over a 128 x 128 block) at a random offset, with scales of STD / 112 around
    1 (each block its own), so writing 1 + N V3 layers takes seconds per layer, not minutes of random draws."""
    import ml_dtypes

    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    pool = np.clip(rng.standard_normal(1 << 26, np.float32) * 112, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    bf16 = ml_dtypes.bfloat16
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    files = {"model.embed.safetensors": [("model.embed_tokens.weight", (V, D), False)],
             "model.head.safetensors": [("model.norm.weight", (D,), False), ("lm_head.weight", (V, D), False)]}
    for layer in range(cfg["num_hidden_layers"]):
        files[f"model.layer{layer:02d}.safetensors"] = _tensors(cfg, layer)
    weight_map = {}
    for fname, tensors in files.items():
        plan = []
        for name, shape, fp8 in tensors:
            if fp8:
                plan += [(name, "F8_E4M3", shape), (name + "_scale_inv", "F32",
                                                    tuple(-(-s // BLOCK) for s in shape))]
            else:
                plan.append((name, "BF16", shape))
        w = _Writer(os.path.join(d, fname), plan)
        for name, shape, fp8 in tensors:
            n = int(np.prod(shape))
            if fp8:
                start = int(rng.integers(0, max(1, pool.size - n)))
                q = np.resize(pool[start:], n) if n > pool.size - start else pool[start:start + n]
                w.write(name, q.reshape(shape))
                sshape = tuple(-(-s // BLOCK) for s in shape)
                w.write(name + "_scale_inv", (STD / 112 * rng.uniform(0.8, 1.2, sshape)).astype(np.float32))
            elif name.endswith("norm.weight"):
                w.write(name, (1 + 0.1 * rng.standard_normal(shape)).astype(bf16))
            elif name.endswith("e_score_correction_bias"):
                w.write(name, rng.uniform(0, 0.1, shape).astype(bf16))
            elif name.endswith("mlp.gate.weight"):  # router logits of O(1) spread: tokens over many experts
                w.write(name, (rng.standard_normal(shape, np.float32) / np.sqrt(shape[1]) * 4).astype(bf16))
            else:
                w.write(name, (rng.standard_normal(shape, np.float32) * STD).astype(bf16))
            weight_map.update({nm: fname for nm, *_ in plan})
        w.close()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


IMPLS = {"attn_impl": "pallas", "moe_impl": "pallas"}  # --cpu-smoke: the XLA paths


def run_engine(d: str, quantization: str, batches: list[int], prompt_len: int, out_len: int, check_prompts,
               compare=None, seed=0, vocab=100000):
    """(the check run's greedy tokens, {batch: (tok/s, distinct experts per layer per step)}) for one load; with
    `compare` (another load's check tokens) their agreement is printed before any timing."""
    import jax

    from deepinfer_jax.config import CacheConfig, RunnerConfig, SchedulerConfig
    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.types import RequestOutputKind, SamplingParams
    from deepinfer_jax.weights.loader import load_model

    t0 = time.time()
    cfg, params = load_model(d, jax.numpy.bfloat16, progress=False, quantization=quantization)
    jax.block_until_ready(params)
    t_load = time.time() - t0
    B = max(batches)
    eng = LLMEngine(cfg, params, None, scheduler_config=SchedulerConfig(
        max_num_seqs=B, max_num_batched_tokens=16384, max_model_len=prompt_len + out_len + 64),
        cache_config=CacheConfig(page_size=64, enable_prefix_caching=False, gpu_memory_utilization=0.9),
        runner_config=RunnerConfig(dtype="bfloat16", **IMPLS, collect_routing=True, warmup_full_variant=False,
                                   token_buckets=tuple(sorted({32, 16384, *batches}))),  # few shapes to compile
        progress=False)
    print(f"[{quantization}] weights loaded in {t_load:.0f}s, ready in {time.time() - t0:.0f}s; KV cache "
          f"{eng.kv_cache_report}", flush=True)
    counter = [0]

    def generate(prompts, n_out):
        for p in prompts:
            counter[0] += 1
            eng.add_request(f"r{counter[0]}", p, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True,
                                                                 output_kind=RequestOutputKind.FINAL_ONLY))
        outs, experts, t = {}, [], time.time()
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            r = eng.runner.last_routing
            if r is not None and eng.runner.last_num_tokens == len(prompts) and len(experts) < 64:
                experts.append(r)
        dt = time.time() - t
        sample = [np.asarray(r)[:, : len(prompts)] for r in experts[1::8]]
        distinct = float(np.mean([len(np.unique(layer)) for r in sample for layer in r])) if sample else float("nan")
        return [outs[k] for k in sorted(outs, key=lambda s: int(s[1:]))], dt, distinct

    check, _, _ = generate(check_prompts, 8)
    if compare is not None:
        agree = np.mean([x == y for s, t in zip(check, compare) for x, y in zip(s, t)])
        first = np.mean([s[0] == t[0] for s, t in zip(check, compare)])
        print(f"greedy agreement of the dequantized bf16 reference with FP8: first token {first:.0%}, all 8 "
              f"positions {agree:.0%}", flush=True)
    rng = np.random.default_rng(seed)
    times = {}
    for b in batches:
        prompts = [rng.integers(2, min(vocab, cfg.vocab_size), prompt_len).tolist() for _ in range(b)]
        generate(prompts[:2], 4)  # every step shape of this batch compiled and run once
        _, dt, distinct = generate(prompts, out_len)
        times[b] = (b * out_len / dt, distinct)
        print(f"[{quantization}] batch {b}: {b}x{prompt_len} in, {out_len} out: {dt:.1f}s -> {times[b][0]:,.0f} "
              f"output tok/s; distinct experts per MoE layer per decode step {distinct:.1f} of "
              f"{cfg.n_routed_experts}", flush=True)
    del eng, params
    gc.collect()
    return check, times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/protocol-f-v3-fp8")
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--skip-bf16", action="store_true", help="the FP8 run only")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="a narrow V3 (hidden 256, 16 experts) on the XLA paths: checks that the script runs")
    a = ap.parse_args(argv)
    import jax

    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    cfg = v3_config(a.moe_layers)
    if a.cpu_smoke:
        cfg.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=2,
                   num_key_value_heads=2, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                   q_lora_rank=128, kv_lora_rank=128, vocab_size=1024)
        IMPLS.update(attn_impl="reference", moe_impl="ragged")
        a.batches, a.prompt_len, a.output_len = "2", 16, 4
    if not os.path.exists(os.path.join(a.dir, "config.json")):
        t = time.time()
        write_checkpoint(a.dir, cfg)
        print(f"wrote the FP8 checkpoint ({cfg['num_hidden_layers']} layers) to {a.dir} in {time.time() - t:.0f}s",
              flush=True)
    batches = [int(b) for b in a.batches.split(",")]
    hi = min(100000, cfg["vocab_size"])
    check_prompts = [np.random.default_rng(100 + i).integers(2, hi, 64).tolist() for i in range(8)]
    fp8_tokens, fp8 = run_engine(a.dir, "auto", batches, a.prompt_len, a.output_len, check_prompts)
    if a.skip_bf16:
        return 0
    _, bf16 = run_engine(a.dir, "none", batches, a.prompt_len, a.output_len, check_prompts, compare=fp8_tokens)
    print(f"\n{'batch':>6} {'FP8 tok/s':>10} {'bf16 tok/s':>11} {'FP8/bf16':>9}")
    for b in batches:
        print(f"{b:>6} {fp8[b][0]:>10,.0f} {bf16[b][0]:>11,.0f} {fp8[b][0] / bf16[b][0]:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
