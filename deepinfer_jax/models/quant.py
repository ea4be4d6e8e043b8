"""Weight-only quantized linear weights: INT8 per output channel, INT4 grouped along the input dim.

A `QuantizedWeight` replaces a float weight leaf of logical shape `[*lead, *in, *out]` in the params
pytree (`lead`: stacked layers L and/or experts E; `in`: contracted axes; `out`: output axes, the last
`n_out` axes). The model dequantizes inside its matmul path (`layers.linear` / `layers.weight`), so one
forward serves float and quantized checkpoints. Invariants (w = the float weight):

- int8: `q` int8, same shape as w, values in [-127, 127]; `scale` fp32 `[*lead, 1 (per in axis), *out]`
  = amax over the in axes / 127, so every output channel of every layer and expert has its own scale;
  w ~= q * scale with |w - q * scale| <= scale / 2 elementwise.
- int4: `q` uint8 `[*lead, *in[:-1], in[-1] // 2, *out]` packing two 4-bit values per byte along the last
  input axis (low nibble = even row, high nibble = odd row, each stored as value + 8, values in [-8, 7]);
  `scale` fp32 `[*lead, *in[:-1], in[-1] // group_size, *out]`, one per group of each output channel:
  alpha * (-m / 8) with m the group's largest-magnitude (signed) value, so m maps onto -8 and all 16
  levels are used, and alpha in `INT4_ALPHAS` the shrink (outlier clipping) that minimises the group's
  squared error (scales may be negative; w ~= q * scale). `group_size` is
  `int4_group(in[-1], requested)`: a divisor of in[-1] at most the requested size, chosen so the group
  count splits evenly over up to 8 devices where it can (V2-Lite's Im = 1408 gets 88); it is stored
  per leaf. For o_proj [H, dv, D] groups run along dv within each head.
- `bits`, `group_size` (0 for int8) and `n_out` are static pytree fields: `lax.scan` over the stacked
  layer axis and `jit` see only `q` and `scale` as arrays.

Which leaves are quantized is `QUANTIZED_LEAVES` (keyed by the leaf's own name): the MLA projections,
the dense MLP, the routed and shared experts. Embeddings, lm_head, norms, the router gate and its
correction bias stay in the model dtype.

FP8 block-scaled weights (DeepSeek-V3's checkpoint format) are an `Fp8Weight` instead: the checkpoint's
own e4m3 tensors and `weight_scale_inv` blocks, kept as they are (see its docstring). `is_quantized` is
true for both kinds, so every float-only kernel path steps aside for either; `dequantize` and
`quantized_matmul` serve both. DeepSeek-V4's FP4 routed experts are an `Fp4Weight` (models/quant_fp4.py), a
third kind served the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.models.quant_fp4 import Fp4Weight, PackedShape, fp4_dequantize, is_fp4

# leaf name -> (n_in, n_out): how many axes before the outputs are contracted, how many are outputs.
QUANTIZED_LEAVES: dict[str, tuple[int, int]] = {
    "q_proj": (1, 2),  # [D, H, dqk]
    "q_a_proj": (1, 1),  # [D, Rq]
    "q_b_proj": (1, 2),  # [Rq, H, dqk]
    "kv_a_proj_with_mqa": (1, 1),  # [D, R + dr]
    "kv_b_proj": (1, 2),  # [R, H, dn + dv]
    "o_proj": (2, 1),  # [H, dv, D]
    "kv_proj": (1, 3),  # [D, 2, KVH, hd] (the dense family's k and v)
    "gate_up": (1, 2),  # [D, 2, I] (mlp, shared) / [E, D, 2, I] (experts)
    "down": (1, 1),  # [I, D] / [E, I, D]
}
METHODS = {"none": 0, "int8": 8, "int4": 4}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    q: Any
    scale: Any
    bits: int = dataclasses.field(metadata=dict(static=True), default=8)
    group_size: int = dataclasses.field(metadata=dict(static=True), default=0)
    n_out: int = dataclasses.field(metadata=dict(static=True), default=1)

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's logical shape."""
        s = tuple(self.q.shape)
        if self.bits == 4:
            ax = len(s) - self.n_out - 1
            s = s[:ax] + (2 * s[ax],) + s[ax + 1:]
        return s

    @property
    def ndim(self) -> int:
        return len(self.q.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight(PackedShape):
    """A block-scaled FP8 weight exactly as the checkpoint stores it, for a float leaf of logical shape
    `[*lead, *in_shape, *out_shape]` (`lead`: stacked layers L and/or experts E).

    Invariant: each HF tensor keeps its own blocks, in HF's `[out, in]` orientation.
    - `q` float8_e4m3fn `[*lead, N, K]`: the HF weight [out, in] with N = prod(out_shape) rows and
      K = prod(in_shape) columns, flattened row-major as HF flattens them (q_b_proj's rows run over H * dqk,
      o_proj's columns over H * dv). With `parts` = 2 (FP8_PARTS_LEAVES: gate and up, or k and v, are separate
      HF tensors, each blocked on its own) `q` is `[*lead, 2, I, D]` and out_shape is (2, I) (kv_proj:
      `[*lead, 2, KVH * hd, D]`, out_shape (2, KVH, hd)).
    - `scale` fp32 `[*lead, (2,) cdiv(N, bn), cdiv(K, bk)]`: HF's `weight_scale_inv`, so
      w[n, k] = float(q[n, k]) * scale[n // bn, k // bk]; edge blocks may be partial (any block size).
    - `block` = (bn, bk), HF's `weight_block_size` (rows, columns); `in_shape`, `out_shape`, `parts`
      are static, so `lax.scan` over the stacked layer axis and `jit` see only `q` and `scale`.
    """

    q: Any
    scale: Any
    block: tuple[int, int] = dataclasses.field(metadata=dict(static=True), default=(128, 128))
    in_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True), default=())
    out_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True), default=())
    parts: int = dataclasses.field(metadata=dict(static=True), default=1)


# Leaves whose first output axis gathers separate HF tensors, each blocked on its own: an Fp8Weight of `parts` = 2
# (gate_up: gate_proj and up_proj; the dense family's kv_proj [D, 2, KVH, hd]: k_proj and v_proj).
FP8_PARTS_LEAVES = ("gate_up", "kv_proj")


def fp8_layout(shape: tuple[int, ...], n_in: int, n_out: int, block: tuple[int, int], gate_up: bool
               ) -> tuple[tuple[int, ...], tuple[int, ...], tuple, tuple, int]:
    """(q shape, scale shape, in_shape, out_shape, parts) of the Fp8Weight for a float leaf of `shape`."""
    shape = tuple(shape)
    lead, ins, outs = shape[: len(shape) - n_in - n_out], shape[len(shape) - n_in - n_out: len(shape) - n_out], \
        shape[len(shape) - n_out:]
    bn, bk = block
    K = int(np.prod(ins))
    if gate_up:
        parts, N = outs[0], int(np.prod(outs[1:]))
        q, s = lead + (parts, N, K), lead + (parts, -(-N // bn), -(-K // bk))
    else:
        parts, N = 1, int(np.prod(outs))
        q, s = lead + (N, K), lead + (-(-N // bn), -(-K // bk))
    return q, s, ins, outs, parts


E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
FP8_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size, used for online quantization


def fp8_quantize_blocks(w: np.ndarray, block: tuple[int, int] = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Host-side block quantization of w [*lead, N, K] as DeepSeek's FP8 weights were made:
    scale = amax / 448 per (bn, bk) block (partial edge blocks included), q = e4m3(w / scale).
    -> (q float8_e4m3fn [*lead, N, K], scale fp32 [*lead, cdiv(N, bn), cdiv(K, bk)])."""
    import ml_dtypes

    w = np.asarray(w, np.float32)
    bn, bk = block
    *lead, N, K = w.shape
    sn, sk = -(-N // bn), -(-K // bk)
    padded = np.zeros((*lead, sn * bn, sk * bk), np.float32)
    padded[..., :N, :K] = w
    blocks = padded.reshape(*lead, sn, bn, sk, bk)
    scale = np.max(np.abs(blocks), axis=(-3, -1)) / E4M3_MAX  # [*lead, sn, sk]
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, bn, axis=-2), bk, axis=-1)[..., :N, :K]
    q = np.clip(w / full, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def quantize_fp8(w: np.ndarray, n_in: int, n_out: int, gate_up: bool, block: tuple[int, int] = FP8_BLOCK
                 ) -> Fp8Weight:
    """A float weight [*lead, *in, *out] (engine layout) as the Fp8Weight an FP8 checkpoint of it would load
    as: back to HF's [out, in] per tensor (gate and up apart), then `fp8_quantize_blocks`."""
    w = np.asarray(w, np.float32)
    q_shape, _, ins, outs, parts = fp8_layout(w.shape, n_in, n_out, block, gate_up)
    nl = w.ndim - n_in - n_out
    lead = w.shape[:nl]
    flat = w.reshape(lead + (int(np.prod(ins)),) + tuple(outs))  # [*lead, K, *out]
    hf = np.moveaxis(flat, nl, -1)  # [*lead, *out, K]
    q, scale = fp8_quantize_blocks(hf.reshape(q_shape), block)
    return Fp8Weight(q, scale, tuple(block), tuple(ins), tuple(outs), parts)


def quantize_params_fp8(params: Any, block: tuple[int, int] = FP8_BLOCK) -> Any:
    """A float params tree with every `QUANTIZED_LEAVES` leaf as the Fp8Weight an FP8 checkpoint of it with
    `block` = (bn, bk) loads as (`quantize_fp8`, host-side); other leaves unchanged."""

    def one(path, leaf):
        keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        lay = quant_layout(keys)
        if lay is None:
            return leaf
        fw = quantize_fp8(np.asarray(jnp.asarray(leaf, jnp.float32)), lay[0], lay[1], keys[-1] in FP8_PARTS_LEAVES,
                          block)
        return dataclasses.replace(fw, q=jnp.asarray(fw.q), scale=jnp.asarray(fw.scale))

    return jax.tree_util.tree_map_with_path(one, params)


# Where FP8 weights take the Pallas kernels (the Pallas path on one device). Dense projections: W8A8
# (kernels/fp8_gemm.py) at decode sizes for weights of at least FP8_GEMM_MIN_ELEMENTS, where it beat bf16 weights on
# an H100 (o_proj, the dense MLP, q_b: 1.4-1.7x) and smaller ones lost (q_a [7168, 1536]: 0.7x); prefill sizes
# keep the reference (dequantize + XLA's dot) until benchmarks/fp8_gemm_tiles.py shows the prefill tiles beating
# it. Routed experts: always the quantized grouped GEMMs (never a dequantized copy of the layer's experts),
# W8A8 at decode sizes, W8A16 (bf16 tensor cores, the tiles of the bf16 experts) above.
FP8_KERNEL_MAX_TOKENS = 64
FP8_GEMM_MIN_ELEMENTS = 16 * 2**20
FP8_DECODE_ACT = "fp8"  # the activations of decode-size steps: "fp8" (W8A8) or "bf16" (W8A16, no rounding of x)


def fp8_kernel_act(num_tokens: int, K: int = 0, N: int = 0, experts: bool = False) -> str | None:
    """The one rule (above) for an FP8 weight of [K, N] (or the routed experts) in a step of num_tokens:
    the kernels' activation mode, "fp8" (W8A8) or "bf16" (W8A16), or None for the reference."""
    decode = num_tokens <= FP8_KERNEL_MAX_TOKENS
    if experts:
        return FP8_DECODE_ACT if decode else "bf16"
    return FP8_DECODE_ACT if decode and K * N >= FP8_GEMM_MIN_ELEMENTS else None


def is_fp8(w) -> bool:
    return isinstance(w, Fp8Weight)


def is_packed(w) -> bool:
    """An Fp8Weight or an Fp4Weight: a weight kept as its checkpoint stores it (HF's [out, in] blocks)."""
    return isinstance(w, PackedShape)


def is_quantized(w) -> bool:
    """A QuantizedWeight (INT8 / INT4), an Fp8Weight or an Fp4Weight: any leaf that is not a plain float array."""
    return isinstance(w, (QuantizedWeight, Fp8Weight, Fp4Weight))


def quant_layout(path: tuple) -> tuple[int, int] | None:
    """(n_in, n_out) when the leaf at `path` (keys into the params tree) is quantizable, else None."""
    return QUANTIZED_LEAVES.get(path[-1]) if path and isinstance(path[-1], str) else None


TP_ALIGN = 8  # INT4 group counts are kept multiples of this where possible (see int4_group)


def int4_group(in_len: int, group_size: int) -> int:
    """The INT4 group actually used along an input axis of `in_len` rows, `group_size` the upper bound.

    The largest divisor g of in_len in [group_size / 2, group_size] whose group count in_len / g is a
    multiple of TP_ALIGN, so tensor parallelism up to 8 ways over a contracted axis (down_proj's I)
    splits on group boundaries (DeepSeek-V2-Lite: Im 1408 -> 88, 16 groups; I 10944 -> 114, 96 groups);
    otherwise the largest divisor <= group_size (7168 -> 128; 64 -> 64)."""
    top = max(1, min(group_size, in_len))
    divisors = [g for g in range(top, 0, -1) if in_len % g == 0]
    aligned = [g for g in divisors if 2 * g >= top and (in_len // g) % TP_ALIGN == 0]
    return aligned[0] if aligned else divisors[0]


def quantized_shapes(shape: tuple[int, ...], bits: int, n_in: int, n_out: int, group_size: int
                     ) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(q shape, scale shape, effective group size) for a float weight of `shape`."""
    shape = tuple(shape)
    ax = len(shape) - n_out - 1  # the last input axis
    lead_in, out = shape[:ax + 1], shape[ax + 1:]
    if bits == 8:
        return shape, shape[: len(shape) - n_out - n_in] + (1,) * n_in + out, 0
    if bits != 4:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if shape[ax] % 2:
        raise ValueError(f"INT4 packs pairs along the input axis; {shape} has odd length {shape[ax]} there")
    g = int4_group(shape[ax], group_size)
    return lead_in[:-1] + (shape[ax] // 2,) + out, lead_in[:-1] + (shape[ax] // g,) + out, g


INT4_ALPHAS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def quantize(w: np.ndarray, bits: int, n_in: int, n_out: int, group_size: int = 128) -> QuantizedWeight:
    """Host-side (numpy) symmetric quantization of a float weight [*lead, *in, *out]; see module doc.
    Leading axes (layers, experts) are quantized one slice at a time to bound the fp32 temporaries."""
    w = np.asarray(w)
    q_shape, s_shape, g = quantized_shapes(w.shape, bits, n_in, n_out, group_size)
    if w.ndim > n_in + n_out:
        q = np.empty(q_shape, np.int8 if bits == 8 else np.uint8)
        scale = np.empty(s_shape, np.float32)
        for i in range(w.shape[0]):
            sub = quantize(w[i], bits, n_in, n_out, g or group_size)
            q[i], scale[i] = sub.q, sub.scale
        return QuantizedWeight(q, scale, bits, g, n_out)
    w = w.astype(np.float32, copy=False)
    if bits == 8:
        scale = np.max(np.abs(w), axis=tuple(range(n_in)), keepdims=True) / 127.0  # [1.., *out]
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
        return QuantizedWeight(q, scale, 8, 0, n_out)
    ax = n_in - 1  # the last input axis: packed and grouped
    grouped = w.reshape(w.shape[:ax] + (w.shape[ax] // g, g) + w.shape[ax + 1:])  # [.., in/g, g, *out]
    # Start from the group's largest-magnitude value m mapped onto -8 (all 16 levels used), then
    # shrink the scale (clipping outliers) while that lowers the group's squared error.
    big = np.expand_dims(np.argmax(np.abs(grouped), axis=ax + 1), ax + 1)
    base = -np.take_along_axis(grouped, big, axis=ax + 1) / 8.0  # [.., in/g, 1, *out]
    best_s, best_err = None, None
    for alpha in INT4_ALPHAS:
        s = np.where(base != 0, base * alpha, 1.0).astype(np.float32)
        err = np.sum(np.square(np.clip(np.rint(grouped / s), -8, 7) * s - grouped), axis=ax + 1, keepdims=True)
        if best_s is None:
            best_s, best_err = s, err
        else:
            better = err < best_err
            best_s, best_err = np.where(better, s, best_s), np.where(better, err, best_err)
    v = np.clip(np.rint(grouped / best_s), -8, 7).astype(np.int16).reshape(w.shape) + 8  # [0, 15]
    even = np.take(v, np.arange(0, w.shape[ax], 2), axis=ax)
    odd = np.take(v, np.arange(1, w.shape[ax], 2), axis=ax)
    q = (even | (odd << 4)).astype(np.uint8)
    scale = best_s.squeeze(ax + 1)
    assert q.shape == q_shape and scale.shape == s_shape, (q.shape, scale.shape)
    return QuantizedWeight(q, scale, 4, g, n_out)


def fp8_dequantize(w: Fp8Weight, dtype=jnp.bfloat16) -> jax.Array:
    """float(q) * scale per block in fp32 (exactly HF's dequantization), then to the logical layout
    [*lead, *in, *out] and cast to dtype."""
    bn, bk = w.block
    N, K = w.q.shape[-2:]
    s = jnp.repeat(jnp.repeat(w.scale.astype(jnp.float32), bn, axis=-2)[..., :N, :], bk, axis=-1)[..., :K]
    full = w.q.astype(jnp.float32) * s  # [*lead, (2,) N, K]
    nl = len(w.lead)
    if w.parts > 1:
        full = jnp.moveaxis(full, -1, nl)  # [*lead, K, 2, N]
    else:
        full = jnp.swapaxes(full, -1, -2)  # [*lead, K, N]
    return full.reshape(w.shape).astype(dtype)


def dequantize(w, dtype=jnp.bfloat16) -> jax.Array:
    """Back to a float array of the logical shape [*lead, *in, *out] (computed in fp32, cast to dtype)."""
    if is_fp8(w):
        return fp8_dequantize(w, dtype)
    if is_fp4(w):
        return fp4_dequantize(w, dtype)
    if w.bits == 8:
        return (w.q.astype(jnp.float32) * w.scale.astype(jnp.float32)).astype(dtype)
    ax = w.q.ndim - w.n_out - 1  # packed input axis
    lo = (w.q & 0x0F).astype(jnp.int32) - 8  # even input rows
    hi = (w.q >> 4).astype(jnp.int32) - 8  # odd input rows
    vals = jnp.stack([lo, hi], axis=ax + 1)  # [.., in/2, 2, *out]
    n_in_last = 2 * w.q.shape[ax]
    g = w.group_size
    grouped = vals.reshape(w.q.shape[:ax] + (n_in_last // g, g) + w.q.shape[ax + 1:])  # [.., in/g, g, *out]
    out = grouped.astype(jnp.float32) * jnp.expand_dims(w.scale.astype(jnp.float32), ax + 1)
    return out.reshape(w.shape).astype(dtype)


def fp8_linear(x: jax.Array, w: Fp8Weight) -> jax.Array:
    """x: [..., K] @ dequant(w): [K, N] -> [..., N] for an unstacked weight with one input and one output
    axis (q [N, K], or gate_up [2, I, D] viewed as [D, 2I]). The reference: dequantize in fp32, cast to x's
    dtype, dot. The kernel path reads stacked weights in place instead (`layers.stacked_matmul`, where
    `fp8_kernel_act` routes a decode step's projection to kernels/fp8_gemm.py)."""
    if len(w.shape) != 2:
        raise ValueError(f"fp8_linear needs an unstacked [in, out] weight, got logical shape {w.shape}")
    return jnp.einsum("...i,io->...o", x, fp8_dequantize(w, x.dtype))


def quantized_matmul(x: jax.Array, w) -> jax.Array:
    """x: [..., in] @ dequant(w): [in, out] -> [..., out] for a 2-D weight. INT8 folds the per-channel
    scale in after the matmul (q is exact in bf16); INT4 dequantizes the grouped weight first; FP8 goes
    through `fp8_linear`."""
    if is_fp8(w):
        return fp8_linear(x, w)
    if is_fp4(w):
        if len(w.shape) != 2:
            raise ValueError(f"quantized_matmul needs an unstacked [in, out] weight, got logical shape {w.shape}")
        return jnp.einsum("...i,io->...o", x, fp4_dequantize(w, x.dtype))
    if w.q.ndim != 2 or w.n_out != 1:
        raise ValueError(f"quantized_matmul needs a 2-D [in, out] weight, got q {w.q.shape} n_out {w.n_out}")
    if w.bits == 8:
        y = jnp.einsum("...i,io->...o", x, w.q.astype(x.dtype), preferred_element_type=jnp.float32)
        return (y * w.scale[0].astype(jnp.float32)).astype(x.dtype)
    return jnp.einsum("...i,io->...o", x, dequantize(w, x.dtype))


def flatten_out_dims(w):
    """Merge the output axes into one: [.., in, *out] -> [.., in, prod(out)] (gate_up [D, 2, I] -> [D, 2I])."""
    if is_fp8(w) or is_fp4(w):  # the stored tensors stay as they are; only the logical view merges
        return dataclasses.replace(w, out_shape=(int(np.prod(w.out_shape)),))
    if w.n_out == 1:
        return w
    q = w.q.reshape(w.q.shape[: w.q.ndim - w.n_out] + (-1,))
    scale = w.scale.reshape(w.scale.shape[: w.scale.ndim - w.n_out] + (-1,))
    return QuantizedWeight(q, scale, w.bits, w.group_size, 1)


def quantize_params(params: Any, method: str, group_size: int = 128) -> Any:
    """A float params tree with every `QUANTIZED_LEAVES` leaf quantized (on the host, leaf by leaf);
    other leaves are returned unchanged. method: "none" | "int8" | "int4"."""
    bits = METHODS[method]
    if not bits:
        return params

    def one(path, leaf):
        keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        lay = quant_layout(keys)
        if lay is None:
            return leaf
        qw = quantize(np.asarray(jnp.asarray(leaf, jnp.float32)), bits, lay[0], lay[1], group_size)
        return QuantizedWeight(jnp.asarray(qw.q), jnp.asarray(qw.scale), qw.bits, qw.group_size, qw.n_out)

    return jax.tree_util.tree_map_with_path(one, params)


def weights_nbytes(params: Any) -> int:
    """Bytes held by every array in the params tree (q and scale of quantized leaves included)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
