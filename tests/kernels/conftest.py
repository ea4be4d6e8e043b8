"""Fixtures of the kernel tests."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture
def cuda_lowering(monkeypatch):
    """lower(fn, *args) -> fn's jax.stages.Lowered for CUDA on this CPU machine (an sm_90 device assumed, as
    Pallas-Triton's lowering asks the GPU for its compute capability)."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    class _H200:
        compute_capability = 90  # an int, as jax's gpu_info reports it (FP8 casts compare it with 89)

    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: _H200())
    return lambda fn, *args: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
