"""The Triton backend's compiler parameters of a kernel launch, or None in interpret mode (the CPU path,
which takes none)."""

from __future__ import annotations


def compiler_params(num_warps: int, num_stages: int, interpret: bool):
    """plgpu.CompilerParams(num_warps, num_stages) for the GPU; None where `interpret` runs the kernel on the CPU."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
