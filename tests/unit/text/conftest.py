"""Fixtures for the text-room tests: a byte-level BPE tokenizer trained here with `tokenizers`
(English, CJK, emoji corpus; DeepSeek's special tokens with their exact names) written into
temporary model directories and loaded through `load_tokenizer`. Helpers live in
text_helpers.py."""

from __future__ import annotations

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.abspath(os.path.join(_HERE, "..", "..", ".."))
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from text_helpers import train_bpe_tokenizer_json, write_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def bpe_json() -> str:
    return train_bpe_tokenizer_json()


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
