"""A model's sampling defaults from its Hugging Face generation_config.json, as vLLM's `--generation-config`
reads them (ModelConfig.get_diff_sampling_param). Plain Python: no JAX.

`source` is "auto" (the model directory's generation_config.json, if it has one), "vllm" (none: the neutral
defaults of SamplingParams) or a folder holding a generation_config.json. Of the file, temperature, top_p,
top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens) are read; a key at Hugging Face's own
default (GenerationConfig: temperature 1.0, top_p 1.0, top_k 50, repetition_penalty 1.0) is not a default here,
as vLLM reads the file through GenerationConfig.to_diff_dict. They fill the fields a request does not set; a
request's own value wins. From a folder given by path (not "auto"), max_new_tokens also caps every request's
max_tokens, as vLLM's override_max_tokens does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

FILE = "generation_config.json"
KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class SamplingDefaults:
    """values: {SamplingParams field: value}; max_tokens_cap: the cap on every request's max_tokens, or None;
    path: the file read, or None."""

    values: dict[str, Any] = field(default_factory=dict)
    max_tokens_cap: int | None = None
    path: str | None = None

    def log_line(self) -> str | None:
        """vLLM's start-up line, with the values, or None when nothing is overridden."""
        if not self.values:
            return None
        shown = ", ".join(f"{k}={v}" for k, v in sorted(self.values.items()))
        cap = f"; max_tokens capped at {self.max_tokens_cap}" if self.max_tokens_cap is not None else ""
        return (f"Default sampling parameters have been overridden by the model's Hugging Face generation config "
                f"({self.path}): {shown}{cap}. Pass --generation-config vllm to use the neutral defaults.")


def _check(path: str, key: str, value: Any) -> None:
    from deepinfer_jax.types import SamplingParams

    bad = f"{path}: {key} must be "
    if key == "max_new_tokens":
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{bad}a positive integer, got {value!r}")
        return
    kinds = (int,) if key == "top_k" else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ValueError(f"{bad}{'an integer' if key == 'top_k' else 'a number'}, got {value!r}")
    try:
        SamplingParams(**{key: value})
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if key == "temperature" and value > 2.0:
        raise ValueError(f"{bad}in [0, 2], got {value!r}")


def load_sampling_defaults(model_dir: str, source: str = "auto") -> SamplingDefaults:
    """The defaults `source` ("auto", "vllm" or a folder) gives; a bad file is a one-line ValueError naming it."""
    if source == "vllm":
        return SamplingDefaults()
    folder = model_dir if source == "auto" else source
    path = os.path.join(folder, FILE)
    if source != "auto" and not os.path.isfile(path):
        raise ValueError(f"generation config {source!r} is not a folder holding a {FILE} (give one, 'auto' for the "
                         "model's or 'vllm' for none)")
    if not os.path.isfile(path):
        return SamplingDefaults()
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a JSON object, got {type(raw).__name__}")
    values = {}
    for key in KEYS:
        v = raw.get(key)
        if v is None or (key in _HF_DEFAULTS and v == _HF_DEFAULTS[key] and not isinstance(v, bool)):
            continue
        _check(path, key, v)
        values["max_tokens" if key == "max_new_tokens" else key] = v
    cap = values.get("max_tokens") if source != "auto" else None
    return SamplingDefaults(values, cap, path)
