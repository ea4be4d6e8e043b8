"""One entry point for the engine: a model directory (HF safetensors or converted orbax) -> params.

A directory holding `deepinfer_checkpoint.json` is a converted checkpoint (weights/orbax_io.py): its
arrays are restored straight onto their shardings, quantized leaves as `QuantizedWeight`. Anything
else is read as a Hugging Face directory (weights/hf_loader.py). Either way the bytes the weights
take on device are logged.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.quant import weights_nbytes
from deepinfer_jax.weights.hf_loader import load_hf_checkpoint
from deepinfer_jax.weights.orbax_io import is_converted, load_converted

log = logging.getLogger(__name__)

__all__ = ["load_model", "is_converted", "weights_nbytes"]


def load_model(model_dir: str, dtype: Any = jnp.bfloat16, shardings: Any = None, progress: bool = True
               ) -> tuple[ModelConfig, dict]:
    """Returns (ModelConfig, params) with every leaf on its device (or `shardings`, a params-shaped tree
    of jax.sharding.Sharding; at a quantized leaf either the float leaf's sharding or a
    QuantizedWeight of shardings for q and scale)."""
    if is_converted(model_dir):
        cfg, params = load_converted(model_dir, dtype, shardings=shardings, progress=progress)
        kind = "converted"
    else:
        cfg = ModelConfig.from_model_dir(model_dir)
        with open(os.path.join(model_dir, "config.json")) as f:
            hf_config = json.load(f)
        cfg, params = load_hf_checkpoint(model_dir, cfg, dtype, shardings=shardings, progress=progress,
                                         hf_config=hf_config)
        kind = "HF"
    log.info("loaded %s checkpoint %s: weights take %.3f GiB on device", kind, model_dir,
             weights_nbytes(params) / 2**30)
    return cfg, params
