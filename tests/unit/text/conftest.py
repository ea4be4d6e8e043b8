"""Fixtures for the text-room tests: a byte-level BPE tokenizer trained here with `tokenizers`
(English, CJK, emoji corpus; DeepSeek's special tokens with their exact names) written into
temporary model directories and loaded through `load_tokenizer`."""

from __future__ import annotations

import json
import os
import sys

import pytest

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

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


@pytest.fixture(scope="session")
def bpe_json() -> str:
    return train_bpe_tokenizer_json()


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


@pytest.fixture
def make_dir(tmp_path, bpe_json):
    """make_dir(name, tokenizer_config=..., config=..., extra_files=...) -> model dir path."""

    def _make(name: str = "deepseek-v3-tiny", **kw) -> str:
        return write_model_dir(tmp_path / name, bpe_json, **kw)

    return _make


@pytest.fixture(scope="session")
def tok_v3(tmp_path_factory, bpe_json):
    from deepinfer_jax.text import load_tokenizer

    d = write_model_dir(tmp_path_factory.mktemp("m") / "DeepSeek-V3-tiny", bpe_json,
                        config={"model_type": "deepseek_v3", "bos_token_id": 0, "eos_token_id": 1})
    return load_tokenizer(d)
