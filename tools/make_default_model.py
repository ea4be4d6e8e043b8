"""Build an untrained demo model (bigram embeddings, random layers): the embedded default model before
tools/train_default_model.py trained one. Its helpers (`train_tokenizer`, `write_safetensors`,
`tensor_names`, `model_config`) serve tests/e2e and the trainer.

    python tools/make_default_model.py --out DIR [--vocab-size 2048] [--hidden-size 256] [--seed 0]

What it writes (about 3 MB, no downloads; deterministic for a given Python version):
- tokenizer.json: a byte-level BPE trained with `tokenizers` on English prose that ships with Python
  (the pydoc topic texts of the language reference), with DeepSeek's special tokens under their exact
  names (BOS id 0, EOS id 1, <think>/</think> as ordinary added tokens, as in R1);
- tokenizer_config.json: BOS/EOS, add_bos_token, and the built-in deepseek_v3 chat template;
- config.json: a tiny DeepSeek-V3-architecture model (2 layers: one dense, one MoE with 8 routed experts
  top-2 plus a shared expert, MLA with q-LoRA), bf16;
- model.safetensors: weights. The attention and MLP weights are random (std 0.02), so every code path
  of the engine runs; their outputs are small next to the embeddings, so the residual stream stays
  close to the current token's embedding. Embedding and lm_head are set so that logits = a rank-255
  factorisation of a smoothed bigram table of the corpus (sentences start after <｜Assistant｜> and
  end with EOS). The model therefore babbles English-looking word salad and stops after a sentence or
  so -- it is a demo of the serving stack, not a language model.

`train_tokenizer`, `write_safetensors` and `tensor_names` are reused by tests/e2e to build crafted
checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SPECIAL = [BOS, EOS, "<｜▁pad▁｜>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>", USER, ASSISTANT,
           "<|EOT|>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
           "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
           "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"]
NOT_SPECIAL = ["<think>", "</think>"]


def corpus_sentences() -> list[str]:
    """English sentences from Python's bundled pydoc topics (sorted by topic: deterministic)."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[key]):
            if para.startswith((" ", "\t")) or ">>>" in para:
                continue  # code blocks
            para = " ".join(para.split())
            for s in re.split(r"(?<=[.!?])\s+", para):
                if len(s.split()) >= 4 and sum(ch.isalpha() for ch in s) > 0.7 * len(s):
                    out.append(s)
    return out


def train_tokenizer(texts: list[str], vocab_size: int, special: list[str] = SPECIAL,
                    added: list[str] = NOT_SPECIAL):
    """Byte-level BPE; `special` get ids 0.. in order, `added` follow as non-special added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(added), special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok


def tokenizer_config(chat_template: str) -> dict:
    return {"add_bos_token": True, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS,
            "pad_token": EOS, "legacy": True, "model_max_length": 4096, "tokenizer_class": "LlamaTokenizerFast",
            "chat_template": chat_template}


def model_config(vocab_size: int, hidden: int) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": vocab_size,
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "moe_intermediate_size": hidden // 4,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": None, "num_nextn_predict_layers": 0, "bos_token_id": 0, "eos_token_id": 1,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
    }


def tensor_names(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, HF shape) of every tensor the engine loads for this config.json dict."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.weights.name_table import expected_tensors

    seen, out = set(), []
    for rule in expected_tensors(ModelConfig.from_hf_dict(config)):
        if rule.hf_name not in seen:
            seen.add(rule.hf_name)
            out.append((rule.hf_name, tuple(rule.hf_shape)))
    return out


def random_weights(config: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Norms 1, router biases 0, everything else N(0, 0.02^2); fp32."""
    out = {}
    for name, shape in tensor_names(config):
        if "norm" in name:
            out[name] = np.ones(shape, np.float32)
        elif name.endswith("e_score_correction_bias"):
            out[name] = np.zeros(shape, np.float32)
        else:
            out[name] = rng.normal(0.0, 0.02, shape).astype(np.float32)
    return out


def write_safetensors(path: str, tensors: dict[str, np.ndarray], dtype: str = "BF16") -> None:
    """Write `tensors` (float arrays) as one safetensors file in BF16 or F32."""
    import ml_dtypes

    np_dtype = {"BF16": ml_dtypes.bfloat16, "F32": np.float32}[dtype]
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(np.asarray(tensors[name], np.float32).astype(np_dtype)).tobytes()
        header[name] = {"dtype": dtype, "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def bigram_logits(streams: list[list[int]], vocab: int, alpha: float = 0.5) -> np.ndarray:
    """log P(next | current), add-alpha smoothed towards the unigram distribution; rows centred."""
    counts = np.zeros((vocab, vocab), np.float64)
    for ids in streams:
        a = np.asarray(ids)
        np.add.at(counts, (a[:-1], a[1:]), 1.0)
    uni = counts.sum(0) + 1.0
    uni /= uni.sum()
    probs = (counts + alpha * uni) / (counts.sum(1, keepdims=True) + alpha)
    logp = np.log(probs)
    return logp - logp.mean(1, keepdims=True)


def embed_and_head(logits: np.ndarray, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """E [V, hidden], W [V, hidden] with rms(E[t]) = 1 for all t and W @ E[t] ~= logits[t] (rank hidden-1)."""
    k = hidden - 1
    u, s, vt = np.linalg.svd(logits, full_matrices=False)
    a = u[:, :k] * np.sqrt(s[:k])          # [V, k]
    b = vt[:k].T * np.sqrt(s[:k])          # [V, k]
    target = np.sqrt(hidden)                # |E[t]| = sqrt(hidden) -> RMSNorm(E[t]) = E[t]
    gamma = 0.99 * target / np.linalg.norm(a, axis=1).max()
    fill = np.sqrt(target**2 - (gamma * np.linalg.norm(a, axis=1)) ** 2)
    emb = np.concatenate([gamma * a, fill[:, None]], axis=1)
    head = np.concatenate([b / gamma, np.zeros((len(b), 1))], axis=1)
    return emb.astype(np.float32), head.astype(np.float32)


def build(out: str, vocab_size: int = 2048, hidden: int = 256, seed: int = 0) -> None:
    from deepinfer_jax.text import BUILTIN_TEMPLATES

    os.makedirs(out, exist_ok=True)
    sentences = corpus_sentences()
    tok = train_tokenizer(sentences, vocab_size)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(BUILTIN_TEMPLATES["deepseek_v3"]), f, ensure_ascii=False, indent=1)
    vocab = tok.get_vocab_size()
    config = model_config(vocab, hidden)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    bos, eos, asst = (tok.token_to_id(t) for t in (BOS, EOS, ASSISTANT))
    streams = [[asst] + enc.ids + [eos] for enc in tok.encode_batch(sentences, add_special_tokens=False)]
    emb, head = embed_and_head(bigram_logits(streams, vocab), hidden)
    rng = np.random.default_rng(seed)
    weights = random_weights(config, rng)
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = emb, head
    write_safetensors(os.path.join(out, "model.safetensors"), weights)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"wrote {out}: vocab {vocab}, hidden {hidden}, {len(sentences)} training sentences, "
          f"{size / 2**20:.1f} MiB (bos {bos}, eos {eos})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (the shipped default model is trained: "
                                                 "tools/train_default_model.py)")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    build(a.out, a.vocab_size, a.hidden_size, a.seed)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
