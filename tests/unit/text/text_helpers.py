"""Shared helpers for the text-room tests (a uniquely named module, imported by the tests and
by conftest.py): DeepSeek special-token names, a small multilingual corpus, an in-test trained
byte-level BPE tokenizer and model-directory writer, and token-level streaming of a text."""

from __future__ import annotations

import json
import os
import random

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
# §5 order (ids differ from the real vocabulary; names are exact)
DEEPSEEK_SPECIALS = [
    BOS, EOS, "<｜▁pad▁｜>", "<think>", "</think>", "<｜fim▁hole｜>", "<｜fim▁begin｜>",
    "<｜fim▁end｜>", "<｜User｜>", "<｜Assistant｜>", "<|EOT|>", "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>", "<｜tool▁sep｜>",
]
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Streaming detokenization must never emit half a character.",
    "What is the weather in Paris today? Let me check the forecast.",
    '{"city": "Paris", "unit": "celsius", "days": 3}',
    "def add(a, b):\n    return a + b\n",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "深度求索的模型支持工具调用和推理。",
    "こんにちは、世界。カタカナとひらがな。",
    "Emoji time 😀🎉👍🚀 and flags 🇫🇷 plus ❤️ hearts.",
    "Numbers 12345 and 3.14159 and 2025-01-20.",
]


def train_bpe_tokenizer_json(vocab_size: int = 700) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=DEEPSEEK_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 5, trainer)
    return tok.to_str()


def write_model_dir(path, tokenizer_json: str, *, tokenizer_config: dict | None = None,
                    config: dict | None = None, extra_files: dict | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    tc = {"add_bos_token": True, "add_eos_token": False,
          "bos_token": {"__type": "AddedToken", "content": BOS, "lstrip": False,
                        "normalized": True, "rstrip": False, "single_word": False},
          "eos_token": EOS, "pad_token": EOS, "legacy": True,
          "tokenizer_class": "LlamaTokenizerFast"}
    if tokenizer_config is not None:
        tc.update(tokenizer_config)
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tc, f, ensure_ascii=False)
    if config is not None:
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
    for name, text in (extra_files or {}).items():
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            f.write(text)
    return str(path)



def token_deltas(tok, text: str, rng: random.Random | None = None, keep=()) -> list[str]:
    """Encode `text` and stream its ids through an IncrementalDetokenizer, one token per step
    (rng None) or a random 1..6 tokens per step; returns the text deltas (maybe "" entries)."""
    from deepinfer_jax.text import IncrementalDetokenizer

    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, skip_special_tokens=True, keep_special_tokens=keep)
    out, pos = [], 0
    while pos < len(ids):
        n = 1 if rng is None else rng.randint(1, 6)
        out.append(det.add(ids[pos:pos + n]))
        pos += n
    out.append(det.flush())
    assert "".join(out) == text, "test text must survive detokenization"
    return out
