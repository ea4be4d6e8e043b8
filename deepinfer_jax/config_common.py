"""What every configuration module shares (config.py re-exports both; config_v4.py reads them). No JAX."""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """An HF config that this engine cannot serve, with the offending field named."""


@dataclass(frozen=True)
class RopeScaling:
    """`rope_scaling` / HF v5's `rope_parameters`: YaRN (DeepSeek); yarn, linear or llama3 (dense family)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    rope_type: str = "yarn"  # "yarn" | "linear" | "llama3"
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    attention_factor: float | None = None  # yarn (dense): cos/sin amplitude; None = from factor and mscales
    truncate: bool = True  # yarn (dense): floor/ceil the correction range
