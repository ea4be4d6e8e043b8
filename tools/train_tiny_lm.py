"""Train the tiny byte-level DeepSeek-V3 language models behind the quantization accuracy test.

    python tools/train_tiny_lm.py [--out tests/data/tiny_lm] [--steps 4000] [--only moe|dense]

What it writes (about 1.9 MB in all, committed; the test never trains):
- moe/, dense/: HF checkpoints (`save_pretrained`, config.json + model.safetensors in bf16) of two
  3-layer DeepSeek-V3 models with vocab 256 (token = byte), hidden 128, MLA with q-LoRA 64 / kv-LoRA 64,
  4 heads (nope 32, rope 16, v 32), YaRN. "moe": 1 dense layer (intermediate 128) + 2 MoE layers of
  8 routed experts (intermediate 32, 4 groups, top-2 within the 2 best groups, noaux_tc sigmoid routing)
  and 1 shared expert; "dense": 3 dense layers (intermediate 160).
- heldout.txt: HELDOUT_WINDOWS windows of WINDOW bytes, concatenated, cut at line starts from the
  held-out files; the test reads it as a [HELDOUT_WINDOWS, WINDOW] byte array.
- train_log.json: the configuration, the loss curve and the final held-out loss of each model.

Corpus: the Python standard library's own .py source files (`sysconfig.get_paths()["stdlib"]`, minus
site-packages and test suites), sorted by path: real text that is on every machine with Python, no
download. A file is held out when crc32(its relative path) % 20 == 0 (about 5%); training never reads
held-out files. Training: next-byte cross-entropy, fp32, AdamW (0.9, 0.95, weight decay 0.1),
linear warm-up then cosine decay, gradient clipping at 1, batches of 32 x 128 bytes from random offsets;
the routers' e_score_correction_bias is updated as in DeepSeek-V3's auxiliary-loss-free balancing
(bias += 1e-3 * sign(mean load - expert load) after every step). Deterministic for a given seed,
Python stdlib and torch build (about 10 minutes per model on 2 CPU cores); the committed files are the
reference, so regenerating on another machine changes the figures in benchmarks/RESULTS.md slightly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

DEFAULT_OUT = os.path.join(ROOT, "tests", "data", "tiny_lm")
WINDOW, HELDOUT_WINDOWS = 128, 32
BASE = dict(  # overrides of the `v3_grouped_noaux` case in tests/hf_models.py
    vocab_size=256, hidden_size=128, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=2, moe_intermediate_size=32, initializer_range=0.02,
)
VARIANTS = {
    "moe": dict(BASE, first_k_dense_replace=1, intermediate_size=128),
    "dense": dict(BASE, first_k_dense_replace=3, intermediate_size=160),
}


def stdlib_files() -> list[tuple[str, bytes]]:
    """(relative path, bytes) of the stdlib's .py files, sorted; no site-packages, no test suites."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "test", "tests", "__pycache__"))
        for f in sorted(files):
            if f.endswith(".py"):
                p = os.path.join(d, f)
                with open(p, "rb") as fh:
                    out.append((os.path.relpath(p, root), fh.read()))
    return out


def is_heldout(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % 20 == 0


def corpus() -> tuple[np.ndarray, np.ndarray]:
    """(train bytes, held-out bytes) as uint8 arrays; files joined with a blank line."""
    files = stdlib_files()
    join = lambda xs: np.frombuffer(b"\n\n".join(xs), np.uint8)
    return join([b for r, b in files if not is_heldout(r)]), join([b for r, b in files if is_heldout(r)])


def heldout_windows(held: np.ndarray, n: int, width: int = WINDOW) -> np.ndarray:
    """n windows of `width` bytes at evenly spaced offsets, each moved to the next line start."""
    out = []
    for k in range(n):
        i = (k * (len(held) - 4 * width)) // n
        while held[i - 1] != ord("\n"):
            i += 1
        out.append(held[i:i + width])
    return np.stack(out)


def build(variant: str, seed: int):
    """A fresh fp32 HF model: HF's normal(0, 0.02) init; norms 1, router bias 0 (undo the test jitter)."""
    import torch

    from hf_models import build_hf_model

    model = build_hf_model("v3_grouped_noaux", seed=seed, **VARIANTS[variant])
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
    return model


def loss_of(model, batch) -> "torch.Tensor":  # noqa: F821
    import torch

    logits = model(torch.as_tensor(batch[:, :-1], dtype=torch.long), use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.as_tensor(batch[:, 1:], dtype=torch.long).reshape(-1))


def train(variant: str, train_bytes: np.ndarray, eval_batch: np.ndarray, steps: int, seed: int = 0,
          batch: int = 32, lr: float = 2e-3, warmup: int = 200) -> tuple[object, dict]:
    import torch

    torch.manual_seed(seed)
    model = build(variant, seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    loads: list = []
    for g in gates:  # count each step's expert choices for the balancing bias update
        g.register_forward_hook(lambda mod, inp, out: loads.append((mod, out[2])))
    rng = np.random.default_rng(seed)
    curve, t0 = [], time.time()
    for step in range(steps):
        offs = rng.integers(0, len(train_bytes) - WINDOW - 1, batch)
        x = np.stack([train_bytes[o:o + WINDOW + 1] for o in offs])
        loads.clear()
        loss = loss_of(model, x)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            for mod, idx in loads:
                cnt = torch.bincount(idx.reshape(-1), minlength=mod.num_experts).float()
                mod.e_score_correction_bias += 1e-3 * torch.sign(cnt.mean() - cnt)
                mod.e_score_correction_bias -= mod.e_score_correction_bias.min()  # same choices, >= 0
        if step % 250 == 0 or step == steps - 1:
            model.eval()
            with torch.no_grad():
                ev = float(loss_of(model, eval_batch))
            model.train()
            curve.append(dict(step=step, train_loss=round(loss.item(), 4), heldout_loss=round(ev, 4)))
            print(f"[{variant}] step {step} train {loss.item():.3f} held-out {ev:.3f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    model.eval()
    return model, dict(steps=steps, batch=batch, window=WINDOW, lr=lr, warmup=warmup, seed=seed,
                       final_heldout_loss=curve[-1]["heldout_loss"], curve=curve,
                       train_seconds=round(time.time() - t0))


def main(argv=None) -> None:
    import torch

    from hf_models import save_hf_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--only", choices=sorted(VARIANTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    train_bytes, held = corpus()
    print(f"corpus: {len(train_bytes)} training bytes, {len(held)} held-out bytes")
    os.makedirs(args.out, exist_ok=True)
    windows = heldout_windows(held, HELDOUT_WINDOWS, WINDOW)
    with open(os.path.join(args.out, "heldout.txt"), "wb") as f:
        f.write(windows.tobytes())
    eval_batch = heldout_windows(held, 64, WINDOW + 1)  # a larger held-out sample for the loss curve
    log_path = os.path.join(args.out, "train_log.json")
    log = json.load(open(log_path)) if os.path.exists(log_path) else {}
    log["corpus"] = dict(python=sys.version.split()[0], train_bytes=len(train_bytes), heldout_bytes=len(held))
    for variant in [args.only] if args.only else sorted(VARIANTS):
        model, info = train(variant, train_bytes, eval_batch, args.steps)
        save_hf_model(model.to(torch.bfloat16), os.path.join(args.out, variant))
        log[variant] = dict(config=VARIANTS[variant], **info)
        with open(log_path, "w") as f:
            json.dump(log, f, indent=1)


if __name__ == "__main__":
    main()
