"""The model families the engine serves (models/registry.py). `SUPPORTED_MODELS`: HF model_type ->
(family, HF architecture); `supported_architectures()`: the architectures, in that order."""

from deepinfer_jax.config import MODEL_FAMILIES as SUPPORTED_MODELS


def supported_architectures() -> tuple[str, ...]:
    return tuple(arch for _, arch in SUPPORTED_MODELS.values())
