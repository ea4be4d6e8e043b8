"""Engine fixtures: HF greedy references computed once per session, JAX's compilation cache in the session's
cache directory (tests/conftest.py) for the engines built without LLM."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _xla_cache(_session_cache_dir):
    from deepinfer_jax.runner.compile_cache import enable_compilation_cache

    enable_compilation_cache(_session_cache_dir)


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model, prompt_ids, n) -> HF transformers' greedy continuation (memoised)."""
    import torch

    memo: dict = {}

    def run(model, prompt, n):
        key = (id(model), tuple(prompt), n)
        if key not in memo:
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     eos_token_id=None, pad_token_id=0, use_cache=True)
            memo[key] = out[0, len(prompt):].tolist()
        return memo[key]

    return run
