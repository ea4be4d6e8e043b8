"""Pack a step's many small host arrays into one int32 and one float32 buffer (two transfers instead
of ~17), and unpack them inside the jitted step with static slices.

Invariant: `unpack(*pack(tree)[:2], layout)` rebuilds `tree` exactly (uint32 leaves travel bit-cast
through int32). The layout is static (shapes, dtypes, treedef), so each step shape has one layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Layout:
    treedef: Any
    leaves: tuple[tuple[bool, tuple[int, ...], str, int], ...]  # (is_float, shape, dtype, offset)


def pack(tree: Any) -> tuple[np.ndarray, np.ndarray, Layout]:
    leaves, treedef = jax.tree.flatten(tree)
    ints, floats, desc = [], [], []
    n_i = n_f = 0
    for leaf in leaves:
        a = np.asarray(leaf)
        is_float = a.dtype.kind == "f"
        if is_float:
            floats.append(a.astype(np.float32, copy=False).ravel())
            desc.append((True, a.shape, str(a.dtype), n_f))
            n_f += a.size
        else:
            ints.append(a.astype(np.uint32 if a.dtype == np.uint32 else np.int32, copy=False).ravel().view(np.int32))
            desc.append((False, a.shape, str(a.dtype), n_i))
            n_i += a.size
    i = np.concatenate(ints) if ints else np.zeros(0, np.int32)
    f = np.concatenate(floats) if floats else np.zeros(0, np.float32)
    return i, f, Layout(treedef, tuple(desc))


def unpack(ints: jax.Array, floats: jax.Array, layout: Layout) -> Any:
    out = []
    for is_float, shape, dtype, off in layout.leaves:
        n = int(np.prod(shape)) if shape else 1
        src = floats if is_float else ints
        a = jax.lax.slice(src, (off,), (off + n,)).reshape(shape)
        if dtype == "uint32":
            a = jax.lax.bitcast_convert_type(a, jnp.uint32)
        elif a.dtype != jnp.dtype(dtype):
            a = a.astype(dtype)
        out.append(a)
    return jax.tree.unflatten(layout.treedef, out)
