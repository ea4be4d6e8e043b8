"""FP8 projections over a device mesh: the block-scaled FP8 GEMM (kernels/fp8_gemm.py) on each device's slice.

On one device a decode-size step reads o_proj and the dense MLP's gate_up / down from their layer stacks through
the FP8 GEMM where `quant.fp8_kernel_act` sends them (models/decode_kernels.py `decode_stacked`). Under a mesh the
same weights are split as their float leaves are (sharding/packed.py: whole scale blocks a device), and the same
GEMM runs inside one `shard_map` on each device's slice of the stacked `q` and `scale`:

- column-parallel (the output dim split, gate_up's intermediate rows over "tensor"): each device computes its own
  output columns from the whole input; nothing is reduced.
- row-parallel (the input dim split, o_proj's heads and down's intermediate columns over "tensor"): each device
  contracts its slice of K and the fp32 partial sums are added over the devices that split K (`psum`), then cast.
- tokens split over the data axes (data-parallel attention) stay split: each device multiplies its own rows.

W8A8 quantizes the activations per token per 1 x bk group (`fp8_gemm.quantize_act`). A device's K slice starts
and ends on a scale block boundary (whole blocks a device), so its groups are the unsharded input's groups and
their scales the same numbers: the row-parallel product differs from the unsharded kernel's only in the order of
the fp32 sums. The rule is the one device's, applied to the GEMM each device runs (its rows, its slice of K and
N: `Fp8Split.local`); a projection it turns down keeps the reference (dequantize, XLA's dot, split by the
partitioner).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from deepinfer_jax.models.parallel import MeshRules
from deepinfer_jax.models.quant import is_fp8
from deepinfer_jax.models.quant_fp4 import packed_spec


@dataclasses.dataclass(frozen=True)
class Fp8Split:
    """How one stacked FP8 projection and its input are split over `mesh` (static, hashable): `w_spec` the
    partition of q and scale ([L, (2,) N, K]); `x_spec` / `y_spec` of the input [T, *in] and output [T, *out];
    `reduce` the mesh axes (of more than one device) splitting K, whose partial sums are added; `local` the shape
    of each device's GEMM."""

    mesh: object
    w_spec: tuple
    x_spec: tuple
    y_spec: tuple
    reduce: tuple[str, ...]
    local: tuple[int, int, int]  # (rows, K, N) of each device's GEMM


def _axes_of(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def fp8_split(mr: MeshRules, w, axes: tuple, in_dims: int, num_tokens: int) -> Fp8Split | None:
    """The split of the stacked Fp8Weight `w` (float leaf [L, *in, *out] of logical `axes`) and of its input under
    `mr`, in a step of `num_tokens` token slots; None where the GEMM cannot run per device (the layers split, a
    mesh axis splitting both the tokens and the weight, a split packed_spec refuses or that is uneven). Whether it
    takes the kernel is the one device's rule on `local` (models/decode_kernels.py `decode_stacked_splits`)."""
    if not is_fp8(w) or len(axes) != len(w.shape):
        return None
    spec = tuple(mr.spec(axes))
    spec += (None,) * (len(axes) - len(spec))
    ins, outs = spec[1:1 + in_dims], spec[1 + in_dims:]
    tok = tuple(mr.spec(("tokens",)))[0] if mr.size("tokens") > 1 else None
    weight_axes = {a for e in ins + outs for a in _axes_of(e)}
    if spec[0] is not None or weight_axes & set(_axes_of(tok)):  # split layers, or tokens and weight on one axis
        return None
    try:
        w_spec = packed_spec(w, spec)
    except ValueError:
        return None
    shape = w.shape[1:]
    K, N = math.prod(shape[:in_dims]), math.prod(shape[in_dims:])
    k_split, n_split, t_split = (math.prod(mr.mesh.shape[a] for e in entries for a in _axes_of(e))
                                 for entries in (ins, outs, (tok,)))
    if K % k_split or N % n_split or num_tokens % t_split:
        return None
    reduce = tuple(a for a in mr.mesh.axis_names if mr.mesh.shape[a] > 1 and any(a in _axes_of(e) for e in ins))
    return Fp8Split(mr.mesh, w_spec, (tok, *ins), (tok, *outs), reduce,
                    (num_tokens // t_split, K // k_split, N // n_split))


def fp8_matmul_split(matmul, x: jax.Array, w, layer: jax.Array, split: Fp8Split) -> jax.Array:
    """x [T, *in] through layer `layer` of the stacked Fp8Weight `w`, split as `split` lays it out -> [T, *out] in
    x's dtype: `matmul(x, w, layer, out_dtype=...)` (the one-device FP8 GEMM, layers.fp8_stacked_matmul) on each
    device's slice inside shard_map, row-parallel partial sums added in fp32 (module docstring)."""
    if x.ndim != len(split.x_spec):
        raise ValueError(f"fp8_matmul_split: x {x.shape} is not [tokens, *in] for the input spec {split.x_spec}")
    dt = x.dtype

    def local(q, scale, x, layer):
        lw = dataclasses.replace(w, q=q, scale=scale)
        if not split.reduce:
            return matmul(x, lw, layer)
        y = matmul(x, lw, layer, out_dtype=jnp.float32)  # fp32 partial sums over this device's K
        return jax.lax.psum(y, split.reduce).astype(dt)

    spec = P(*split.w_spec)
    fn = jax.shard_map(local, mesh=split.mesh, in_specs=(spec, spec, P(*split.x_spec), P()),
                       out_specs=P(*split.y_spec), check_vma=False)
    return fn(w.q, w.scale, x, layer)
