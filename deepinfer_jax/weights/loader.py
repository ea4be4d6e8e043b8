"""One entry point for the engine: a model directory (HF safetensors or converted orbax) -> params."""

from __future__ import annotations

import json
import os
from typing import Any

import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.weights.hf_loader import load_hf_checkpoint


def load_model(model_dir: str, dtype: Any = jnp.bfloat16, shardings: Any = None, progress: bool = True
               ) -> tuple[ModelConfig, dict]:
    """Returns (ModelConfig, params) with every leaf on its device (or `shardings`)."""
    cfg = ModelConfig.from_model_dir(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        hf_config = json.load(f)
    return load_hf_checkpoint(model_dir, cfg, dtype, shardings=shardings, progress=progress, hf_config=hf_config)
