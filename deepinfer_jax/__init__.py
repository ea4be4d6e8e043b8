"""deepinfer-jax: a JAX/XLA-compiled inference engine for DeepSeek models.

`from deepinfer_jax import LLM, SamplingParams` is the offline API; the pure model functions live in
`deepinfer_jax.models.deepseek`, checkpoint loading in `deepinfer_jax.weights`.
"""

from deepinfer_jax.xla_env import apply_default_xla_flags

apply_default_xla_flags()  # before JAX starts a backend (see xla_env.py)

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import deepinfer_jax` (and the JAX-free rooms) stay cheap.
    if name == "LLM":
        from deepinfer_jax.engine.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutputKind", "StructuredOutputsParams"):
        from deepinfer_jax import types

        return getattr(types, name)
    raise AttributeError(f"module 'deepinfer_jax' has no attribute {name!r}")
