"""Shardings of weights kept as their checkpoints store them: FP8 block-scaled (`quant.Fp8Weight`) and FP4
(`quant_fp4.Fp4Weight`), `q` [*lead, (2,) N, K] in HF's [out, in] orientation with `scale` beside it.

A packed weight is split as its float leaf [*lead, *in, *out] is split by the rules (rules.py): the heads of
q_b_proj / kv_b_proj (rows N) and of o_proj (columns K), the intermediate dim of the dense MLP, the shared and
the routed experts (gate_up's rows, down's columns), the expert axis of the routed experts. `q` and `scale` get
the same partition (`quant_fp4.packed_spec`), so a device holds whole scale blocks with their rows and columns,
provided each device's share of N and of K is a multiple of the block (FP8: weight_block_size's rows and
columns; FP4: the scale group along K). A layout that would cut a block is refused, as vLLM refuses it (its
block-quantized linear layers check `output_partition_size % block_n` and `input_size_per_partition % block_k`),
naming the dimension and the flag to change (`check_blocks`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from deepinfer_jax.models.quant import is_fp8
from deepinfer_jax.models.quant_fp4 import PackedShape, packed_spec
from deepinfer_jax.sharding.rules import AXIS_FLAGS, DIMENSION_NAMES, dimension_name, split_flags


def block_of(w: PackedShape) -> tuple[int, int]:
    """(rows, columns) of w's scale blocks: FP8 its weight_block_size; FP4 one row by its scale group."""
    return tuple(w.block) if is_fp8(w) else (1, w.group)


def _mesh_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def check_blocks(w: PackedShape, spec: tuple, mesh_shape: Mapping[str, int], axes: tuple | None = None,
                 name: str = "") -> None:
    """A ValueError unless the partition `spec` of w's `q` / `scale` (packed_spec) leaves every device whole
    scale blocks. `axes`: the float leaf's logical axes, to name the model dimension and the flag in the message."""
    bn, bk = block_of(w)
    nl, ni = len(w.lead), len(w.in_shape)
    N, K = int(w.q.shape[-2]), int(w.q.shape[-1]) * w.Q_COLUMNS
    kind = "FP8" if is_fp8(w) else "FP4"
    what = f"weight_block_size [{bn}, {bk}]" if is_fp8(w) else f"scale group of {bk} columns"
    for label, entry, size, blk, ax, dims in (
            ("output rows", spec[-2], N, bn, nl + ni + (w.parts > 1), w.out_shape[w.parts > 1:]),
            ("input columns", spec[-1], K, bk, nl, w.in_shape)):
        mesh = _mesh_axes(entry)
        n = math.prod(mesh_shape[a] for a in mesh)
        if n <= 1 or (size % n == 0 and (size // n) % blk == 0):
            continue
        logical = axes[ax] if axes is not None and ax < len(axes) else None
        dim = dimension_name(logical, name) if logical else "its dimension"
        flags = (split_flags(logical, mesh) if logical in DIMENSION_NAMES
                 else " or ".join(AXIS_FLAGS.get(a, a) for a in mesh))
        raise ValueError(
            f"{kind} weight {name}: splitting {dim} = {dims[0]} over {n} devices gives each device {size // n} of "
            f"its {size} {label}, not a multiple of the {what} (a scale block would straddle two devices); "
            f"change {flags}, or load the weights in float (--quantization none)")


def packed_sharding(w: PackedShape, sharding: Any, axes: tuple | None = None, name: str = "") -> PackedShape:
    """w (arrays or abstract) with the shardings of its `q` and `scale` in their place, for its float leaf's
    `sharding`: a NamedSharding's partition mapped onto q's layout (checked with check_blocks; DeepSeek-V4's
    o_a_proj's first put in the axis order of its FP8 form, v4_params.packed_order); any other sharding (one
    device, the host) as it is for both."""
    from jax.sharding import NamedSharding, PartitionSpec

    if not isinstance(sharding, NamedSharding):
        return dataclasses.replace(w, q=sharding, scale=sharding)
    from deepinfer_jax.models.v4_params import packed_order

    axes = None if axes is None else packed_order(name, axes)
    try:
        spec = packed_spec(w, packed_order(name, tuple(sharding.spec)))
    except ValueError as e:  # the dense family's kv_proj [D, 2, KVH, hd] with its KV heads split, e.g.
        mesh = sorted({a for x in sharding.spec for a in _mesh_axes(x)})
        flags = " or ".join(AXIS_FLAGS.get(a, a) for a in mesh)
        raise ValueError(f"{'FP8' if is_fp8(w) else 'FP4'} weight {name}: {e}; change {flags}, or load the weights "
                         "in float (--quantization none)") from None
    check_blocks(w, spec, dict(sharding.mesh.shape), axes, name)
    ns = NamedSharding(sharding.mesh, PartitionSpec(*spec))
    return dataclasses.replace(w, q=ns, scale=ns)
