"""FP4 (e2m1, MXFP4-style) weights as DeepSeek-V4 releases its routed experts, kept packed on the device.

A V4 checkpoint stores each routed expert matrix W [N, K] (HF's [out, in]) as two tensors:
- `weight`: int8 (safetensors "I8") [N, K / 2]: two e2m1 codes a byte along K, the low nibble holding
  the even column k = 2j, the high nibble the odd column 2j + 1. A code is sign (bit 3), exponent (bits 2-1)
  and mantissa (bit 0): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (`E2M1_VALUES`, codes 8-15 their negatives).
- `scale`: float8_e8m0fnu ("F8_E8M0") [N, K / 32]: one power of two 2 ** (byte - 127) per 1 x 32 group of a row.
w[n, k] = e2m1(code[n, k]) * scale[n, k // 32].

`Fp4Weight` holds those bytes as they are: `q` uint8 [*lead, (2,) N, K / 2] and `scale` uint8 (the e8m0 bits)
[*lead, (2,) N, cdiv(K, group)], so the device holds the file's bytes (K / 2 + K / 32 a row). Like
`quant.Fp8Weight` it stands for a float leaf of logical shape [*lead, *in_shape, *out_shape] (`lead`: experts E;
`parts` = 2 for gate_up, gate and up two HF tensors). `fp4_dequantize` is the pure-JAX reference (exact in
fp32: an e2m1 value times a power of two; the decoding is kernels/fp4.py's, which the kernels share);
`quantize_fp4` is the host-side writer (DeepSeek's rounding: the group's scale is amax / 6 rounded up to a power
of two, values rounded to the nearest e2m1, ties to the even code), used to make FP4 checkpoints in tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.kernels.fp4 import E2M1_VALUES, FP4_GROUP, fp4_rows

FP4_MAX = 6.0  # the largest e2m1 magnitude


class PackedShape:
    """The logical shape of a weight kept packed as its checkpoint stores it (Fp4Weight here, quant.Fp8Weight):
    `q` is [*lead, (parts,) rows, packed columns] and `in_shape` / `out_shape` / `parts` are static fields.

    Rows N are the output axes (after `parts`) flattened row-major, columns K the input axes, so a split of the
    first output (input) axis over devices is a split of N (K) into the same contiguous runs (`packed_spec`).
    Inside `shard_map` a device holds such a slice of `q` while the static fields keep the whole weight's axes:
    `shape` reads N and K from `q` and scales the first output / input axis to them, so the local view is the
    logical slice of the float weight."""

    Q_COLUMNS = 1  # input columns a column of q holds (Fp4Weight: 2, a byte packs two codes)

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.q.shape[: len(self.q.shape) - 2 - (self.parts > 1)])

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's logical shape [*lead, *in, *out] (of this device's slice inside shard_map)."""
        ins, outs = list(self.in_shape), list(self.out_shape)
        merged = self.parts > 1 and len(outs) == 1  # quant.flatten_out_dims's [.., 2I] view of gate and up
        first = 1 if self.parts > 1 and not merged else 0
        n, k = int(self.q.shape[-2]), int(self.q.shape[-1]) * self.Q_COLUMNS
        n_all, k_all = int(np.prod(outs[first:])) // (self.parts if merged else 1), int(np.prod(ins))
        if n != n_all:
            outs[first] = outs[first] * n // n_all
        if k != k_all:
            ins[0] = ins[0] * k // k_all
        return self.lead + tuple(ins) + tuple(outs)

    @property
    def ndim(self) -> int:
        return len(self.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp4Weight(PackedShape):
    """Packed e2m1 pairs and e8m0 group scales, in HF's [out, in] orientation (module docstring).
    `group`, `in_shape`, `out_shape`, `parts` are static: `jit` sees only `q` and `scale`."""

    Q_COLUMNS = 2

    q: Any
    scale: Any
    group: int = dataclasses.field(metadata=dict(static=True), default=FP4_GROUP)
    in_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True), default=())
    out_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True), default=())
    parts: int = dataclasses.field(metadata=dict(static=True), default=1)


def is_fp4(w) -> bool:
    return isinstance(w, Fp4Weight)


def packed_spec(w: PackedShape, spec: tuple) -> tuple:
    """The partition of `q` and `scale` ([*lead, (parts,) N, K], the same for both) for the partition `spec` of
    w's float leaf [*lead, *in, *out] (one entry an axis, as a PartitionSpec lists them; missing ones unsplit).
    A split of the first output / input axis is a split of N / K (PackedShape); a split of a later one, or of
    gate and up apart, has no contiguous run of q's rows or columns: a ValueError."""
    nl, ni, no = len(w.lead), len(w.in_shape), len(w.out_shape)
    spec = tuple(spec) + (None,) * (nl + ni + no - len(spec))
    lead, ins, outs = spec[:nl], spec[nl:nl + ni], spec[nl + ni:]
    parts = ()
    if w.parts > 1:
        parts, outs = (None,), outs[1:]
        if spec[nl + ni] is not None:
            raise ValueError(f"a packed weight's gate and up parts cannot be split over devices (partition {spec})")
    for kind, axes in (("output", outs), ("input", ins)):
        if any(a is not None for a in axes[1:]):
            raise ValueError(f"a packed weight of logical shape {w.shape} can only be split along its first {kind} "
                             f"axis, not by the partition {spec}")
    return lead + parts + (outs[0] if outs else None, ins[0] if ins else None)


def fp4_layout(shape: tuple[int, ...], n_out: int, group: int = FP4_GROUP, gate_up: bool = False
               ) -> tuple[tuple[int, ...], tuple[int, ...], tuple, tuple, int]:
    """(q shape, scale shape, in_shape, out_shape, parts) of the Fp4Weight for a float leaf [*lead, K, *out]."""
    shape = tuple(shape)
    lead, K, outs = shape[: len(shape) - n_out - 1], shape[len(shape) - n_out - 1], shape[len(shape) - n_out:]
    if K % 2:
        raise ValueError(f"FP4 packs pairs along the input axis; {shape} has odd length {K} there")
    parts = outs[0] if gate_up else 1
    rows = (parts, int(np.prod(outs[1:]))) if gate_up else (int(np.prod(outs)),)
    return lead + rows + (K // 2,), lead + rows + (-(-K // group),), (K,), outs, parts


def fp4_dequantize(w: Fp4Weight, dtype=jnp.bfloat16) -> jax.Array:
    """The reference: w in fp32 (exact), then to the logical layout [*lead, K, *out] and cast to dtype."""
    full = fp4_rows(w.q, w.scale, w.group)  # [*lead, (2,) N, K]
    nl = len(w.lead)
    full = jnp.moveaxis(full, -1, nl) if w.parts > 1 else jnp.swapaxes(full, -1, -2)
    return full.reshape(w.shape).astype(dtype)


# ---- the host-side writer ---------------------------------------------------------------------------

_MAGS = np.array(E2M1_VALUES[:8], np.float32)
_MIDS = (_MAGS[1:] + _MAGS[:-1]) / 2  # 0.25, 0.75, ..., 5.0


def fp4_quantize_rows(w: np.ndarray, group: int = FP4_GROUP) -> tuple[np.ndarray, np.ndarray]:
    """w [.., N, K] (K even) -> (q uint8 [.., N, K / 2], scale uint8 e8m0 bits [.., N, cdiv(K, group)]):
    per 1 x group block scale = 2 ** ceil(log2(amax / 6)) (amax at least 6 * 2 ** -126), codes the nearest
    e2m1 value of w / scale, ties to the even code, as DeepSeek's fp4 quantizer rounds."""
    w = np.asarray(w, np.float32)
    *lead, N, K = w.shape
    if K % 2:
        raise ValueError(f"FP4 packs pairs along the last axis; {w.shape} has odd length {K}")
    nb = -(-K // group)
    pad = np.zeros((*lead, N, nb * group), np.float32)
    pad[..., :K] = w
    z = pad.reshape(*lead, N, nb, group)
    amax = np.maximum(np.max(np.abs(z), axis=-1, keepdims=True), FP4_MAX * 2.0**-126)
    mant, exp = np.frexp(amax / FP4_MAX)
    exp = np.where(mant == 0.5, exp - 1, exp)  # 2 ** exp >= amax / 6, the smallest such power of two
    scale = np.ldexp(np.float32(1.0), exp).astype(np.float32)
    a = np.minimum(np.abs(z / scale), FP4_MAX)
    lo, hi = np.searchsorted(_MIDS, a, "left"), np.searchsorted(_MIDS, a, "right")
    code = lo + ((hi != lo) & (lo % 2 == 1))  # a tie between two values: the even code
    code = (code | np.where(z < 0, 8, 0)).reshape(*lead, N, nb * group)[..., :K].astype(np.uint8)
    q = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return q, (exp[..., 0] + 127).astype(np.uint8)


def quantize_fp4(w: np.ndarray, n_out: int, gate_up: bool = False, group: int = FP4_GROUP) -> Fp4Weight:
    """A float weight [*lead, K, *out] (engine layout) as the Fp4Weight an FP4 checkpoint of it loads as."""
    w = np.asarray(w, np.float32)
    q_shape, _, ins, outs, parts = fp4_layout(w.shape, n_out, group, gate_up)
    nl = w.ndim - n_out - 1
    hf = np.moveaxis(w, nl, -1)  # [*lead, *out, K]
    q, s = fp4_quantize_rows(hf.reshape(q_shape[:-1] + (w.shape[nl],)), group)
    return Fp4Weight(q, s, group, ins, outs, parts)
