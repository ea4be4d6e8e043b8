"""Train the embedded default model (deepinfer_jax/assets/default-model) from generated conversations.

    python tools/train_default_model.py [--steps N] [--train-seconds T] [--out DIR] [--device-batch B]
                                        [--seed S] [--compute-dtype auto|bfloat16|float32] [--no-eval]
    python tools/train_default_model.py --init DIR [...]  (fine-tune DIR's model, its tokenizer kept)
    python tools/train_default_model.py --eval-only DIR [--eval-n N] [--card README.md]

Data (tools/default_model_data.py, no download): chat, arithmetic with <think> working, get_weather /
get_time tool calls and answers from tool results, JSON with asked keys; every conversation rendered
through the built-in deepseek_v3 chat template (what serving renders), 0-3 earlier exchanges of any skills
before the last turn, loss on the assistant turns but earlier arithmetic replies sent back without their
working (default_model_data.NO_LOSS), and on nothing else.
Tokenizer: a byte-level BPE (`tokenizers`) trained on that text, digits split one by one (sums are
learnt digit by digit) and the space before a capital letter its own token (a name is the same tokens
after a space in prose as after a quote in JSON, so copying it is copying tokens); DeepSeek's special
tokens at ids 0.. (BOS 0, EOS 1), <think>/</think> as added tokens.
Model: DeepSeek-V3 architecture (MLA with q-LoRA, 1 dense + 3 MoE layers of 8 routed experts top-2 plus a
shared one, noaux_tc sigmoid router, one MTP layer), about 5.0M parameters, about 10 MB in bf16 at the
default --hidden-size 256 (a smaller width, e.g. 128, for a quick CPU run).
Training: `jax.grad` of next-token cross-entropy over deepinfer_jax.models.deepseek.forward plus 0.3 x the
MTP module's cross-entropy of the token after next (models/mtp.py), AdamW written here (betas 0.9/0.95,
weight decay 0.1 on matrices), warm-up then cosine decay, clipping at 1; the whole step is one jit.
Batches come from length buckets (--buckets) with the same token count. bf16 weights in the forward on a GPU
(params and AdamW state fp32), fp32 on a CPU. `--train-seconds` ends training after that many seconds of
steps (compilation excluded), the schedule following whichever of steps or time runs out first.
Router correction biases stay 0 (no load-balancing update).
Output (--out): the HF directory (config.json, model.safetensors bf16, tokenizer.json,
tokenizer_config.json), train_log.json, loss.svg; then the evaluation (below) runs on it and writes
README.md (the model card). With transformers installed, the directory is opened with
AutoModelForCausalLM and its logits compared with ours.
Evaluation (--eval-only DIR, or after training): held-out prompts (default_model_data) through our LLM
engine, greedy; rates of chat replies made of known reply sentences, arithmetic correct with reasoning,
tool calls parsed by the deepseek_v3 parser with the right arguments, answers from tool results, JSON with
the asked keys. The rates go into the model card between EVAL markers (tests read them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]

import default_model_data as data  # noqa: E402
from default_eval import evaluate, write_card  # noqa: E402
from make_default_model import NOT_SPECIAL, SPECIAL, tokenizer_config, write_safetensors  # noqa: E402

BUCKETS = (64, 128, 256, 320, 384, 512)  # a conversation of 3 earlier exchanges and the tools: up to ~550
ROW = 256  # --device-batch counts rows of this many tokens
MTP_WEIGHT = 0.3


def model_config(vocab: int, hidden: int = 256) -> dict:
    """The HF config; the widths scale with `hidden` (256: the shipped model; heads of 64 channels)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "moe_intermediate_size": 3 * hidden // 8,
        "num_hidden_layers": 4, "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 64,
        "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "q_lora_rank": hidden // 2, "kv_lora_rank": hidden // 2, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": None, "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
    }


def _render(args):
    seed, n, template, skills = args
    rng = np.random.default_rng(seed)
    pick = lambda: skills[int(rng.integers(len(skills)))] if skills else None
    return [data.render_with_mask(*data.example(rng, skill=pick())[:2], template) for _ in range(n)]


def make_corpus(n: int, seed: int, skills: tuple = ()) -> list[tuple[str, list]]:
    """n rendered training conversations (text, assistant spans), in parallel over the CPU cores; only
    `skills` (equally mixed) when given, else the data module's mix."""
    import multiprocessing

    from deepinfer_jax.text import BUILTIN_TEMPLATES

    template = BUILTIN_TEMPLATES["deepseek_v3"]
    chunks = [(seed * 100003 + i, min(2000, n - i * 2000), template, skills) for i in range(-(-n // 2000))]
    ctx = multiprocessing.get_context("spawn")  # JAX is already running threads: no fork
    with ctx.Pool(max(1, min(len(chunks), os.cpu_count() or 1))) as pool:
        return [x for part in pool.map(_render, chunks) for x in part]


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with digits split one by one and the space before a capital isolated (names tokenize
    alike in prose and in JSON); SPECIAL at ids 0.., NOT_SPECIAL added after."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.Split(Regex(" (?=[A-Z])"), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(NOT_SPECIAL), special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NOT_SPECIAL])
    return tok


def tokenize(tok, corpus, sizes=BUCKETS) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Bucket length -> (ids [N, S] int32 (EOS-padded), loss mask [N, S] bool: token is in an assistant span).
    Conversations longer than the largest bucket are left out."""
    encs = tok.encode_batch([t for t, _ in corpus], add_special_tokens=False)
    rows: dict[int, list] = {b: [] for b in sizes}
    for enc, (_, spans) in zip(encs, corpus):
        ids = enc.ids  # the template renders BOS as text; it is special token id 0
        starts = np.array([s for s, _ in enc.offsets])
        m = np.zeros(len(ids), bool)
        for a, b in spans:
            m |= (starts >= a) & (starts < b)
        m = m.tolist()
        b = next((b for b in sizes if len(ids) <= b), None)
        if b is not None:
            rows[b].append((ids + [1] * (b - len(ids)), m + [False] * (b - len(ids))))
    return {b: (np.array([r[0] for r in v], np.int32), np.array([r[1] for r in v], bool))
            for b, v in rows.items() if v}


def init(cfg, seed: int):
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.models.params import init_params

    params = init_params(cfg, seed=seed, dtype=jnp.float32, std=0.02)
    fix = lambda path, x: (jnp.ones_like(x) if "norm" in jax.tree_util.keystr(path) else
                           jnp.zeros_like(x) if "e_score_correction_bias" in jax.tree_util.keystr(path) else x)
    return jax.tree_util.tree_map_with_path(fix, params)


def make_step(cfg, compute_dtype, wd: float = 0.1, b1: float = 0.9, b2: float = 0.95):
    """The jitted train step: (params, adam state, ids [B, S], mask [B, S], step, lr) -> (params, state, stats)."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.models.deepseek import forward
    from deepinfer_jax.models.mtp import mtp_forward

    def ce(logits, targets, mask):
        lp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(lp, targets[..., None], -1)[..., 0]
        return (nll * mask).sum() / jnp.maximum(mask.sum(), 1)

    def loss_fn(params, ids, mask):
        p = jax.tree_util.tree_map_with_path(  # the engine's layout: all in the model dtype but the router bias
            lambda path, x: x if "e_score_correction_bias" in jax.tree_util.keystr(path) else x.astype(compute_dtype),
            params)
        logits, hidden = forward(p, cfg, ids, moe_impl="dense", return_hidden=True)
        main = ce(logits[:, :-1], ids[:, 1:], mask[:, 1:])
        mtp_logits = mtp_forward(p, cfg, hidden[:, :-1], ids[:, 1:], moe_impl="dense")  # predicts ids[:, 2:]
        mtp = ce(mtp_logits[:, :-1], ids[:, 2:], mask[:, 2:])
        return main + MTP_WEIGHT * mtp, (main, mtp)

    trainable = lambda path: "e_score_correction_bias" not in jax.tree_util.keystr(path)

    def step(params, state, ids, mask, t, lr):
        (_, (main, mtp)), g = jax.value_and_grad(loss_fn, has_aux=True)(params, ids, mask)
        gnorm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))
        scale = jnp.minimum(1.0, 1.0 / (gnorm + 1e-6))
        tf = (t + 1).astype(jnp.float32)
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g * scale, state["m"], g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * (g * scale) ** 2, state["v"], g)

        def upd(path, p, m, v):
            if not trainable(path):
                return p
            u = (m / (1 - b1 ** tf)) / (jnp.sqrt(v / (1 - b2 ** tf)) + 1e-8)
            return p - lr * (u + (wd * p if p.ndim > 1 else 0.0))

        params = jax.tree_util.tree_map_with_path(upd, params, m, v)
        return params, {"m": m, "v": v}, {"main": main, "mtp": mtp, "gnorm": gnorm, "lr": lr}

    return jax.jit(step, donate_argnums=(0, 1))


def to_hf(params, cfg) -> dict[str, np.ndarray]:
    """The params pytree as HF tensors: each name-table rule's transform inverted through an index map."""
    from deepinfer_jax.weights.name_table import expected_tensors

    out: dict[str, np.ndarray] = {}
    for r in expected_tensors(cfg):
        if r.hf_name in out:
            continue
        leaf = params
        for k in r.path:
            leaf = leaf[k]
        target = np.asarray(leaf, np.float32)[r.index] if r.index else np.asarray(leaf, np.float32)
        where = np.asarray(r.transform(np.arange(math.prod(r.hf_shape)).reshape(r.hf_shape)))
        flat = np.empty(math.prod(r.hf_shape), np.float32)
        flat[where.ravel()] = target.ravel()
        out[r.hf_name] = flat.reshape(r.hf_shape)
    return out


def svg_plot(path: str, curves: dict[str, list[tuple[int, float]]]) -> None:
    """Loss curves (log y) as a small hand-written SVG."""
    W, H, pad = 640, 360, 40
    pts = [p for c in curves.values() for p in c]
    x1 = max(p[0] for p in pts) or 1
    lo, hi = math.log(min(p[1] for p in pts)), math.log(max(p[1] for p in pts))
    fx = lambda x: pad + (W - 2 * pad) * x / x1
    fy = lambda y: H - pad - (H - 2 * pad) * (math.log(y) - lo) / max(hi - lo, 1e-9)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{pad}" y="20" font-size="12">loss (log scale) vs step; top {math.exp(hi):.2f}, '
             f'bottom {math.exp(lo):.3f}, last step {x1}</text>']
    for i, ((name, c), col) in enumerate(zip(curves.items(), ["#1f77b4", "#d62728", "#2ca02c"])):
        d = " ".join(f"{fx(x):.1f},{fy(y):.1f}" for x, y in c)
        parts.append(f'<polyline fill="none" stroke="{col}" points="{d}"/>')
        parts.append(f'<text x="{W - 150}" y="{40 + 15 * i}" fill="{col}" font-size="12">{name}</text>')
    with open(path, "w") as f:
        f.write("\n".join(parts + ["</svg>"]))


def save(out: str, tok, hf_cfg: dict, params, cfg) -> None:
    from deepinfer_jax.text import BUILTIN_TEMPLATES

    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(BUILTIN_TEMPLATES["deepseek_v3"]), f, ensure_ascii=False, indent=1)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=1)
    write_safetensors(os.path.join(out, "model.safetensors"), to_hf(params, cfg))


def check_with_hf(out: str, params, cfg) -> float | None:
    """Max |logit difference| between HF transformers' model of `out` and our forward (None without torch)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    import jax.numpy as jnp

    from deepinfer_jax.models.deepseek import forward

    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ids = np.arange(2, 40, dtype=np.int64)[None] % cfg.vocab_size
    with torch.no_grad():
        ref = model(torch.as_tensor(ids)).logits.numpy()
    p16 = __import__("jax").tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
    ours = np.asarray(forward(p16, cfg, jnp.asarray(ids, jnp.int32), moe_impl="dense"))
    return float(np.abs(ours - ref).max())


def train(a) -> str:
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.config import ModelConfig

    t0 = time.time()
    gpu = jax.default_backend() != "cpu"
    tokens_per_step = a.device_batch * ROW
    n_conv = a.conversations or int(min(300_000, max(4000, a.steps * tokens_per_step / 150)))
    corpus = make_corpus(n_conv, a.seed, tuple(a.skills.split(",")) if a.skills else ())
    if a.init:  # fine-tune: its tokenizer and config as they are
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(a.init, "tokenizer.json"))
    else:
        tok = train_tokenizer([t for t, _ in corpus[:20000]], a.vocab_size)
    buckets = tokenize(tok, corpus, a.buckets)
    left_out = len(corpus) - sum(len(v[0]) for v in buckets.values())
    print(f"data: {len(corpus)} conversations ({left_out} longer than {a.buckets[-1]} left out), "
          f"buckets {({b: len(v[0]) for b, v in buckets.items()})}, "
          f"vocab {tok.get_vocab_size()} ({time.time() - t0:.0f} s)", flush=True)
    if a.init:
        from deepinfer_jax.weights.hf_loader import load_hf_checkpoint

        with open(os.path.join(a.init, "config.json")) as f:
            hf_cfg = json.load(f)
        cfg, params = load_hf_checkpoint(a.init, ModelConfig.from_hf_dict(hf_cfg), jnp.float32, progress=False)
        params = jax.tree.map(jnp.asarray, params)
    else:
        hf_cfg = model_config(tok.get_vocab_size(), a.hidden_size)
        cfg = ModelConfig.from_hf_dict(hf_cfg)
        params = init(cfg, a.seed)
    dtype = {"auto": "bfloat16" if gpu else "float32"}.get(a.compute_dtype, a.compute_dtype)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"model: {n_params / 1e6:.2f}M parameters ({2 * n_params / 2**20:.1f} MiB in bf16), "
          f"{dtype} compute on {jax.default_backend()}", flush=True)
    warm = min(200, a.steps // 10 + 1)
    step = make_step(cfg, jnp.dtype(dtype))
    state = {"m": jax.tree.map(jnp.zeros_like, params), "v": jax.tree.map(jnp.zeros_like, params)}
    sizes = sorted(buckets)
    weights = np.array([len(buckets[b][0]) * b for b in sizes], float)
    rng = np.random.default_rng(a.seed)
    t_compile = time.time()
    compiled = {b: step.lower(params, state, jnp.asarray(v[0][:max(1, tokens_per_step // b)]),
                              jnp.asarray(v[1][:max(1, tokens_per_step // b)]), jnp.int32(0), jnp.float32(0)).compile()
                for b, v in buckets.items()}  # before the clock starts: --train-seconds counts steps only
    print(f"compiled {len(compiled)} step programs ({time.time() - t_compile:.0f} s)", flush=True)
    curve, t_train, t = [], time.time(), 0
    while True:
        # progress: the larger of steps done and time used (--train-seconds); warm-up, then cosine to 10%
        progress = max(t / a.steps, (time.time() - t_train) / a.train_seconds if a.train_seconds else 0.0)
        last = progress >= 1.0 or t == a.steps - 1
        lr = a.lr * min(1.0, (t + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))
        b = sizes[int(rng.choice(len(sizes), p=weights / weights.sum()))]
        ids, mask = buckets[b]
        rows = rng.integers(0, len(ids), max(1, tokens_per_step // b))
        params, state, st = compiled[b](params, state, jnp.asarray(ids[rows]), jnp.asarray(mask[rows]),
                                        jnp.int32(t), jnp.float32(lr))
        t += 1
        if (t - 1) % a.log_every == 0 or last:
            st = {k: float(v) for k, v in st.items()}
            curve.append(dict(step=t - 1, **{k: round(v, 5) for k, v in st.items()}))
            print(f"step {t - 1:5d} loss {st['main']:.4f} mtp {st['mtp']:.4f} |g| {st['gnorm']:.2f} "
                  f"lr {st['lr']:.2e} ({time.time() - t_train:.0f} s)", flush=True)
        if last:
            break
    train_s = time.time() - t_train
    save(a.out, tok, hf_cfg, params, cfg)
    svg_plot(os.path.join(a.out, "loss.svg"), {"main": [(c["step"], c["main"]) for c in curve],
                                               "mtp": [(c["step"], c["mtp"]) for c in curve]})
    diff = check_with_hf(a.out, params, cfg)
    base = os.path.join(a.init, "train_log.json") if a.init else None
    base = {k: v for k, v in json.load(open(base)).items() if k != "curve"} if base and os.path.exists(base) else None
    log = dict(base=base, steps=t, seed=a.seed, device_batch=a.device_batch, tokens_per_step=tokens_per_step,
               lr=a.lr, conversations=len(corpus), params=n_params, device=str(jax.devices()[0].device_kind),
               train_seconds=round(train_s), total_seconds=round(time.time() - t0), hf_max_logit_diff=diff,
               curve=curve)
    with open(os.path.join(a.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print(f"saved {a.out} ({train_s:.0f} s of training); HF transformers max |logit diff| vs ours: {diff}")
    return a.out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--out", default=os.path.join(ROOT, "default-model-out"))
    p.add_argument("--device-batch", type=int, default=None,
                   help=f"rows of {ROW} tokens per step (shorter buckets get more rows); default 128 on a GPU, 8 on a CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-seconds", type=float, default=None,
                   help="also end training (and its learning-rate schedule) after this many seconds of steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--compute-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="dtype of the forward's weights (params and AdamW stay fp32); auto: bfloat16 on a GPU")
    p.add_argument("--vocab-size", type=int, default=2048,
                   help="BPE vocabulary (digits are single tokens: 2048 gives as short sequences as 3072)")
    p.add_argument("--buckets", default=",".join(map(str, BUCKETS)),
                   help="sequence-length buckets, one step program each (one bucket, e.g. 384: fastest to compile)")
    p.add_argument("--hidden-size", type=int, default=256,
                   help="model width (a multiple of 64; the other widths follow it); 256 ships")
    p.add_argument("--skills", default=None, help="train only these skills, comma-separated (of "
                   f"{','.join(data.SKILLS)}), equally mixed: quick research runs; the shipped model has all")
    p.add_argument("--conversations", type=int, default=None,
                   help="training conversations to generate (default: about steps x tokens/step / 150, at most 300k)")
    p.add_argument("--init", metavar="DIR", default=None,
                   help="fine-tune the model of DIR (an HF directory this script wrote; its tokenizer and widths "
                        "are kept) instead of training from scratch")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-only", metavar="DIR", help="evaluate DIR (an HF model directory) and write its card")
    p.add_argument("--eval-n", type=int, default=60, help="held-out prompts per skill")
    p.add_argument("--no-eval", action="store_true", help="train and save only (evaluate later with --eval-only)")
    p.add_argument("--card", default=None, help="model card to write (default DIR/README.md)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.eval_n < 1:
        p.error("--steps and --eval-n must be >= 1")
    if a.hidden_size < 64 or a.hidden_size % 64:
        p.error("--hidden-size must be a positive multiple of 64")
    try:
        a.buckets = sorted({int(x) for x in a.buckets.split(",")})
    except ValueError:
        p.error(f"--buckets must be comma-separated integers, got {a.buckets!r}")
    if a.buckets[0] < 8:
        p.error("--buckets must be >= 8")
    if a.skills and not set(a.skills.split(",")) <= set(data.SKILLS):
        p.error(f"--skills must be a comma-separated subset of {','.join(data.SKILLS)}")
    if a.conversations is not None and a.conversations < 100:
        p.error("--conversations must be >= 100")
    if a.eval_only:
        if a.no_eval:
            p.error("--no-eval contradicts --eval-only")
        out = a.eval_only
    else:
        import jax

        if a.device_batch is None:
            a.device_batch = 128 if jax.default_backend() != "cpu" else 8
        out = train(a)
        if a.no_eval:
            return 0
    rates = evaluate(out, a.eval_n, a.seed)
    write_card(a.card or os.path.join(out, "README.md"), out, rates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
