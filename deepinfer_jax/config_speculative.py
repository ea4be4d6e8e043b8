"""Speculative decoding's configuration (vLLM's `speculative_config` keys), parsed and checked without JAX.
`deepinfer_jax.config` re-exports it."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

SPECULATIVE_METHODS = ("ngram", "deepseek_mtp", "draft_model")
# The methods this engine runs; the others are refused at start, naming the method.
IMPLEMENTED_SPECULATIVE_METHODS = ("ngram", "deepseek_mtp", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys). Each step a speculating sequence proposes up to
    `num_speculative_tokens` (K) tokens and the target model verifies them and its own next token in one pass.

    `ngram`: prompt lookup over the request's own prompt and output (the last n tokens, n from prompt_lookup_max
    down to prompt_lookup_min, matched earlier in the sequence; the tokens after the match are the proposal).
    `deepseek_mtp`: the checkpoint's multi-token-prediction layer. `draft_model`: a smaller model at `model`."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not one of {', '.join(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs 'model' (the draft's directory)")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config 'model' is for method 'draft_model', not {self.method!r}")
        if self.method != "ngram":
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config {name!r} is for method 'ngram', not {self.method!r}")
            return
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        # vLLM's defaults: both 5 when neither is given, else the one given for both.
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min {lo} exceeds prompt_lookup_max {hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """A SpeculativeConfig from a mapping or its JSON text (None stays None); unknown keys are named."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a mapping, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown} (known: {sorted(names)})")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**value)

    def check_supported(self) -> None:
        """Refuse, naming it, a method this engine does not run yet, and a draft model directory that does not exist
        (before anything loads; engine/spec_draft.py checks the draft's vocabulary)."""
        if self.method not in IMPLEMENTED_SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not supported yet (supported: "
                             f"{', '.join(IMPLEMENTED_SPECULATIVE_METHODS)})")
        if self.method == "draft_model" and not os.path.isdir(self.model):
            raise ValueError(f"speculative_config model {self.model!r} (the draft) is not a directory")

    @staticmethod
    def check_parallel(pipeline_parallel_size: int) -> None:
        """Refuse pipeline parallelism in one line naming both flags: the MTP layer, the draft's steps and the
        verify rows run with tensor and data parallelism (docs/speculative.md), not across pipeline stages."""
        if pipeline_parallel_size > 1:
            raise ValueError("--speculative-config is not supported with --pipeline-parallel-size > 1 "
                             "(speculative decoding runs with tensor and data parallelism, not pipeline stages)")
