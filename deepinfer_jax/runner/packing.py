"""Pack a step's many small host arrays into one int32 and one float32 buffer (two transfers instead
of ~17), and unpack them inside the jitted step with static slices.

Invariant: `unpack(*pack(tree)[:2], layout)` rebuilds `tree` exactly (uint32 leaves travel bit-cast
through int32). The layout is static (shapes, dtypes, treedef), so each step shape has one layout.

`pack_bits` / `unpack_bits` go the other way, device to host: a step's results in one int32 buffer
(floats bit-cast), so that they land in the step program's resident outbox (runner/model_runner.py).
Invariant: `unpack_bits(np.asarray(pack_bits(tree)), bits_layout(tree))` rebuilds `tree` exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Layout:
    treedef: Any
    leaves: tuple[tuple[bool, tuple[int, ...], str, int], ...]  # (is_float, shape, dtype, offset)


def sizes(layout: Layout) -> tuple[int, int]:
    """(ints, floats) element counts of a `pack` layout."""
    n = [0, 0]
    for is_float, shape, _, _ in layout.leaves:
        n[is_float] += math.prod(shape)
    return n[0], n[1]


_DTYPE_NAMES: dict = {}  # np.dtype -> its name: str(dtype) takes microseconds, and a step packs ~20 leaves twice


def _name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def pack(tree: Any) -> tuple[np.ndarray, np.ndarray, Layout]:
    leaves, treedef = jax.tree.flatten(tree)
    ints, floats, desc = [], [], []
    n_i = n_f = 0
    for leaf in leaves:
        a = np.asarray(leaf)
        dtype = a.dtype
        if dtype.kind == "f":
            floats.append(a.astype(np.float32, copy=False).ravel())
            desc.append((True, a.shape, _name(dtype), n_f))
            n_f += a.size
        else:
            ints.append(a.astype(np.uint32 if dtype == np.uint32 else np.int32, copy=False).ravel().view(np.int32))
            desc.append((False, a.shape, _name(dtype), n_i))
            n_i += a.size
    i = np.concatenate(ints) if ints else np.zeros(0, np.int32)
    f = np.concatenate(floats) if floats else np.zeros(0, np.float32)
    return i, f, Layout(treedef, tuple(desc))


def unpack(ints: jax.Array, floats: jax.Array, layout: Layout) -> Any:
    out = []
    for is_float, shape, dtype, off in layout.leaves:
        n = math.prod(shape)
        src = floats if is_float else ints
        a = jax.lax.slice(src, (off,), (off + n,)).reshape(shape)
        if dtype == "uint32":
            a = jax.lax.bitcast_convert_type(a, jnp.uint32)
        elif a.dtype != jnp.dtype(dtype):
            a = a.astype(dtype)
        out.append(a)
    return jax.tree.unflatten(layout.treedef, out)


# ---- one int32 buffer, floats bit-cast: a step's results in its resident outbox ---------------------
def bits_layout(tree: Any) -> Layout:
    """The layout of `tree` (arrays or ShapeDtypeStructs of 32-bit or narrower ints and floats) in one
    int32 buffer: leaves one after another, floats bit-cast from float32. `Layout.leaves[i][3]` is the
    leaf's offset in that buffer."""
    leaves, treedef = jax.tree.flatten(tree)
    desc, n = [], 0
    for leaf in leaves:
        desc.append((jnp.dtype(leaf.dtype).kind == "f", tuple(leaf.shape), str(jnp.dtype(leaf.dtype)), n))
        n += math.prod(leaf.shape)
    return Layout(treedef, tuple(desc))


def bits_size(layout: Layout) -> int:
    return sum(math.prod(shape) for _, shape, _, _ in layout.leaves)


def pack_bits(tree: Any) -> jax.Array:
    """Inside a jitted function: `tree` -> int32 [bits_size(bits_layout(tree))]."""
    parts = []
    for leaf in jax.tree.leaves(tree):
        a = jnp.ravel(leaf)
        if jnp.issubdtype(a.dtype, jnp.floating):
            a = jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)
        elif a.dtype == jnp.uint32:
            a = jax.lax.bitcast_convert_type(a, jnp.int32)
        parts.append(a.astype(jnp.int32))
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.int32)


def unpack_bits(buf: np.ndarray, layout: Layout) -> Any:
    """On the host: the inverse of `pack_bits` (numpy leaves of the original dtypes)."""
    out = []
    for is_float, shape, dtype, off in layout.leaves:
        a = buf[off:off + math.prod(shape)]
        a = a.view(np.float32) if is_float else (a.view(np.uint32) if dtype == "uint32" else a)
        out.append(a.reshape(shape).astype(dtype, copy=False))
    return jax.tree.unflatten(layout.treedef, out)
