"""64-bit pointer offsets for large 1-byte arrays in the Pallas-Triton lowering (`wide_offsets_for_bytes`).

Pallas-Triton computes a load's or store's pointer offsets in elements, in i32 unless the whole array is over
2**32 bytes, and Triton adds an i32 offset to a pointer as a signed value. For 2-byte and wider dtypes the rule
is safe (2**32 bytes holds at most 2**31 elements), but a 1-byte array (float8_e4m3fn, int8, packed int4)
between 2**31 and 2**32 elements gets i32 offsets that wrap negative past element 2**31: at DeepSeek-V3's
shape one layer's FP8 down_proj experts [1, 256, 7168, 2048] (3.8 GB) or the stacked q_b_proj [61, 24576,
1536] (2.3 GB) are read out of bounds (CUDA_ERROR_ILLEGAL_ADDRESS). The patch hands the offset computation a
2-byte dtype of the same shape for such arrays, only to choose the offset width (the offsets are in elements,
so nothing else changes): i64 from 2**31 elements. It patches a function of the pinned jax (pyproject.toml)
and applies only where that function has the expected form (runner/lowering.py's convention).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import threading

log = logging.getLogger(__name__)

_ARGS = ["block_info", "nd_indexer"]
_lock = threading.Lock()


def _needs_wider(shape, dtype) -> bool:
    """Whether an array of this shape and dtype has 2**31 elements or more within 2**32 bytes (i32 offsets)."""
    import numpy as np

    n = math.prod(shape)
    return np.dtype(dtype).itemsize == 1 and n >= 2**31 and n <= 2**32


def wide_offsets_for_bytes() -> bool:
    """Install the patch (idempotent, thread-safe); False where Pallas-Triton's lowering has another form."""
    with _lock:
        try:
            from jax._src.pallas.triton import lowering
        except ImportError:
            return False
        compute = getattr(lowering, "_compute_offsets_from_indices", None)
        if compute is None:
            return False
        if getattr(compute, "_wide_for_bytes", False):
            return True
        if list(inspect.signature(compute).parameters) != _ARGS or not dataclasses.is_dataclass(
                getattr(lowering, "BlockInfo", None)):
            log.warning("Pallas-Triton's offset computation has another form: 1-byte arrays of 2**31 to 2**32 "
                        "elements keep 32-bit offsets")
            return False

        def compute_wide(block_info, nd_indexer):
            full = block_info.full_shape_dtype
            if _needs_wider(full.shape, full.dtype):
                import jax.numpy as jnp
                from jax._src import core

                block_info = dataclasses.replace(block_info,
                                                 full_shape_dtype=core.ShapedArray(full.shape, jnp.uint16))
            return compute(block_info, nd_indexer)

        compute_wide._wide_for_bytes = True
        lowering._compute_offsets_from_indices = compute_wide
        return True
