"""The Triton backend's compiler parameters of a kernel launch, or None in interpret mode (the CPU path,
which takes none). Asking for them also installs kernels/triton_offsets.py's patch (64-bit offsets for large
1-byte arrays), so every GPU kernel lowers with it."""

from __future__ import annotations


def compiler_params(num_warps: int, num_stages: int, interpret: bool):
    """plgpu.CompilerParams(num_warps, num_stages) for the GPU; None where `interpret` runs the kernel on the CPU."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    from deepinfer_jax.kernels.triton_offsets import wide_offsets_for_bytes

    wide_offsets_for_bytes()  # before any GPU kernel lowers: 1-byte weights of 2**31+ elements

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
