"""The MoE grouped GEMMs on quantized expert weights, dequantized inside the kernels (Pallas, Triton backend).

The layout and the two kernels are kernels/moe_gmm.py's (token copies sorted by expert into row blocks of one
expert each, `align_tokens`; gate_up with the SwiGLU fused, then down; the weighted combine in JAX), with
each weight tile read in its stored format and widened in registers, so a step streams the quantized bytes
and never forms a bf16 copy of the experts. Formats (`WeightFormat`, one for each of the two weights, since
INT4's group is chosen per leaf), with the stacked layouts of models/quant.py and DeepSeek's FP8 checkpoints:

    kind   gate_up q / scale                           down q / scale
    int8   [L, E, D, 2, I] int8 / [L, E, 1, 2, I]       [L, E, I, D] int8 / [L, E, 1, D]      (per column)
    int4   [L, E, D/2, 2, I] uint8 / [L, E, D/g, 2, I]  [L, E, I/2, D] uint8 / [L, E, I/g, D]  (g rows a group)
    fp8    [L, E, D, 2, I] e4m3 / [L, E, D/bk, 2, I/bn] [L, E, I, D] e4m3 / [L, E, I/bk, D/bn] (bk x bn blocks)
    fp8 "nk" [L, E, 2, I, D] / [L, E, 2, I/bn, D/bk]    [L, E, D, I] / [L, E, D/bn, I/bk]     (HF's [out, in])
    fp4 "nk" [L, E, 2, I, D/2] uint8 / [L, E, 2, I, D/g]  [L, E, D, I/2] / [L, E, D, I/g]      (e8m0 bytes, g = 32)

FP8 weights come in either orientation (`WeightFormat.layout`): "kn" as the INT ones, or "nk", each HF tensor
as the checkpoint stores it with its `weight_scale_inv` (models/quant.py's Fp8Weight: gate and up two parts),
multiplied by the transposed tile in the kernel, so no transposed copy is made.

- int8 (W8A16): q widened to bf16 (exact), the fp32 product scaled per column after the K loop.
- int4 (W4A16): two 4-bit rows a byte (low nibble = even row, high = odd, stored + 8); a K step unpacks its
  [tile_k / 2, tile_n] bytes into the even and the odd rows, scales each by its group's scale in fp32 (as
  models/quant.py `dequantize`), and multiplies them by x's even and odd columns (strided loads).
- fp4 (W4A16, DeepSeek-V4's routed experts, models/quant_fp4.py): two e2m1 codes a byte along K (low nibble =
  even column), one e8m0 scale per row and 1 x g group. A K step is tk columns, the largest power of two dividing
  K up to block_k (whole groups, or within one): its [tn, tk / 2] bytes decode into two tiles, the step's even
  and its odd columns, each value times its group's 2 ** (s - 127) in x's dtype (exact in bf16: e2m1 times a
  power of two; the step's [tn, G] scales broadcast to each byte), by a PTX byte-lookup block on the GPU
  (kernels/fp4.py `nibble_values`: about 3 instructions a value, where integer ops and an fp32 multiply took
  about 13). x (h for down) arrives with each step's columns split the same
  way (`split_pairs`, a JAX reorder of the activations), so a step is two tk / 2-deep dots on contiguous halves
  of x's step with fp32 accumulation, and the weight tile is never interleaved back into K order.
- fp8, act="bf16" (W8A16): q widened to bf16 (exact), each K step's product scaled by its block's scale.
- fp8, act="fp8" (W8A8, FP8 tensor cores): x quantized per token group of 1 x bk (`fp8_gemm.quantize_act`)
  beside the gate_up kernel; the gate_up kernel quantizes h the same way in its epilogue when its column tile is
  the down weight's bk (one scale per row per tile, no second pass over h), else h is stored in fp32 and
  quantized in JAX.

`swiglu_limit` (DeepSeek-V4): the gate clamped to <= limit and up to [-limit, limit] before silu(gate) * up.

Three parts (ARCHITECTURE.md rule 6): `moe_experts_quant` (the kernels; `interpret=True` on the CPU),
`moe_experts_quant_reference` (pure JAX: the weights dequantized whole, `moe_gmm.moe_experts_reference`'s
arithmetic; with fp8 act="fp8", x and h rounded through `quantize_act`) and `supported` (the tile predicate).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.decode_matmul import largest_pow2_divisor
from deepinfer_jax.kernels.fp4 import e8m0_to_float, fp4_rows, nibble_values
from deepinfer_jax.kernels.fp8_gemm import FP8, FP8_MAX, dequant_fp8, dot_nk, quantize_act
from deepinfer_jax.kernels.moe_gmm import EXACT, align_tokens, cols_first_for, combine_rows, tile_config
from deepinfer_jax.kernels.triton_params import compiler_params


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How one expert weight is stored: kind "int8" | "int4" | "fp8" | "fp4"; group: INT4's rows per scale group
    (models/quant.py's group_size), FP8's block rows bk or FP4's group (32); block_n: FP8's block columns bn;
    act: FP8's activations, "fp8" (W8A8) or "bf16" (W8A16); layout: FP8's orientation, "kn" or "nk" (FP4: "nk",
    the checkpoint's; module docstring)."""
    kind: str
    group: int = 0
    block_n: int = 0
    act: str = "bf16"
    layout: str = "kn"

    def __post_init__(self):
        if self.kind not in ("int8", "int4", "fp8", "fp4"):
            raise ValueError(f"WeightFormat: kind must be 'int8', 'int4', 'fp8' or 'fp4', got {self.kind!r}")
        if self.act not in ("bf16", "fp8") or (self.act == "fp8" and self.kind != "fp8"):
            raise ValueError(f"WeightFormat: act {self.act!r} is not available for {self.kind}")
        layouts = {"fp8": ("kn", "nk"), "fp4": ("nk",)}.get(self.kind, ("kn",))
        if self.layout not in layouts:
            raise ValueError(f"WeightFormat: layout {self.layout!r} is not available for {self.kind}")


def _tiles(f: WeightFormat, K: int, N: int, block_n: int, block_k: int) -> tuple[int, int] | None:
    """(tile_k, tile_n) of one kernel over a [K, N] weight in format f (at most block_k / block_n), or None."""
    tn = largest_pow2_divisor(N, block_n)
    tk = largest_pow2_divisor(K, block_k)
    if f.kind == "int4":  # whole bytes a step (tk even), 16-deep dots on each half
        tk = largest_pow2_divisor(K, max(block_k, 32))
        if f.group % 2 or tk < 32:  # a row pair straddling two groups: none in models/quant.py's groups
            return None
    if f.kind == "fp4":  # whole groups a step (or a step within one group): one tk-deep dot
        tk = largest_pow2_divisor(K, max(block_k, 32))
        while tk > 32 and tk % f.group and f.group % tk:
            tk //= 2
        if K % f.group or f.group % 32 or tk < 32:
            return None
    if f.kind == "fp8":  # a step within one scale block, a column tile within one
        tk = largest_pow2_divisor(f.group, block_k if f.act == "bf16" else max(block_k, 32))
        tn = largest_pow2_divisor(f.block_n, block_n)
        if K % f.group or N % f.block_n or (f.act == "fp8" and tk < 32):
            return None
    return (tk, tn) if tk >= 16 and tn >= 16 else None


FP4_STEP_BYTES = 8192  # an FP4 K step's weight bytes a tile (tn x tk / 2)


def fp4_block_k(tn: int) -> int:
    """The FP4 kernels' K-step cap for column tiles of tn: FP4_STEP_BYTES of bytes a step. On an H100 at V4-Flash's
    experts (benchmarks/fp4_experts.py): 128-column steps of 128-wide tiles took 2.13 / 9.08 ms at 32 / 4,096
    tokens against 2.33 / 13.37 with 64; 256-wide tiles (128 tokens) took 4.63 ms with 64 against 7.99 with 128."""
    return max(32, 2 * FP4_STEP_BYTES // tn)


def supported(fmt_gu: WeightFormat, fmt_down: WeightFormat, D: int, I: int, num_copies: int) -> bool:
    """Whether the kernels take experts of hidden size D, width I in these formats at this step size."""
    _, block_n, block_k, _, _ = tile_config(num_copies)
    return _tiles(fmt_gu, D, I, block_n, block_k) is not None and _tiles(fmt_down, I, D, block_n, block_k) is not None


def _partial(f, i, tk, tn, n, x_at, xs_at, q_at, s_at, asm=False, swap=False):
    """The fp32 [bm, tn] product of K step i ([tn, bm], its transpose, with `swap`): x_at(k slice) -> x's rows
    [bm, tk] (strided slices for INT4), xs_at(block) -> their FP8 scales [bm], q_at(k slice) -> the stored weight
    tile, s_at(k index, column index) -> scales (a slice, an index array or a block number)."""
    k0 = i * tk
    if f.kind == "int8":
        x = x_at(pl.ds(k0, tk))
        return jnp.dot(x, q_at(pl.ds(k0, tk)).astype(x.dtype), preferred_element_type=jnp.float32, precision=EXACT)
    if f.kind == "int4":
        half = tk // 2
        b = q_at(pl.ds(k0 // 2, half)).astype(jnp.int32)  # [tk / 2, tn] bytes
        cols = pl.ds(n * tn, tn)
        if f.group % tk == 0:  # the step inside one group: one scale row
            s_even = s_odd = s_at(pl.ds(k0 // f.group, 1), cols)  # [1, tn]
        else:  # groups change within the step: each row's scale (even groups keep a pair in one group)
            grp = (k0 + 2 * jax.lax.broadcasted_iota(jnp.int32, (half,), 0)) // f.group
            s_even = s_odd = s_at(grp, cols)  # [tk / 2, tn]
        x_even = x_at(pl.ds(k0, half, stride=2))
        lo = (((b & 15) - 8).astype(jnp.float32) * s_even).astype(x_even.dtype)
        hi = (((b >> 4) - 8).astype(jnp.float32) * s_odd).astype(x_even.dtype)
        dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=EXACT)
        return dot(x_even, lo) + dot(x_at(pl.ds(k0 + 1, half, stride=2)), hi)
    if f.kind == "fp4":  # [tn, tk / 2] bytes of the "nk" tile; the step's G groups' scales [tn, G]
        half, per = tk // 2, min(tk, f.group) // 2  # bytes a row, bytes a scale covers within the step
        s = e8m0_to_float(s_at(pl.ds(k0 // f.group, half // per), pl.ds(n * tn, tn)))  # [tn, G]
        s = jnp.broadcast_to(s[:, :, None], (tn, half // per, per)).reshape(tn, half)  # each byte's scale
        x_even = x_at(pl.ds(k0, half))  # x arrives pairs-split (`split_pairs`): the step's even columns, then odd
        lo, hi = nibble_values(q_at(pl.ds(k0 // 2, half)), s, x_even.dtype, asm=asm)
        x_odd = x_at(pl.ds(k0 + half, half))
        if swap:
            return dot_nk(lo, x_even, precision=EXACT) + dot_nk(hi, x_odd, precision=EXACT)
        return dot_nk(x_even, lo, precision=EXACT) + dot_nk(x_odd, hi, precision=EXACT)
    kb = k0 // f.group
    scale = s_at(kb, (n * tn) // f.block_n)
    w = q_at(pl.ds(k0, tk))  # [tk, tn], or [tn, tk] for "nk"
    x = x_at(pl.ds(k0, tk))
    if swap:  # "nk" only (`swappable`): [tn, tk] . [bm, tk] -> [tn, bm], both operands K-major as stored
        if f.act == "fp8":
            return dot_nk(w, x) * (xs_at(kb)[None, :] * scale)
        return dot_nk(w.astype(x.dtype), x, precision=EXACT) * scale
    dot = dot_nk if f.layout == "nk" else functools.partial(jnp.dot, preferred_element_type=jnp.float32)
    if f.act == "fp8":
        return dot(x, w) * (xs_at(kb)[:, None] * scale)
    return dot(x, w.astype(x.dtype), precision=EXACT) * scale


def _block_and_tile(cols_first):
    first = pl.program_id(0)
    return (pl.program_id(1), first) if cols_first else (first, pl.program_id(1))


def _gate_up_kernel(layer_ref, be_ref, x_ref, xs_ref, q_ref, s_ref, h_ref, *hs, f, bm, tk, tn, K, E, cols_first,
                    quant_h, limit, asm, swap):
    """h[rows, tile n] = silu(x @ W_gate[e][:, n]) * (x @ W_up[e][:, n]) for row block b (x gathered [M_pad, D]);
    with quant_h, h in e4m3 and its scale per row hs[rows, n] (the tile is one 1 x tn group)."""
    b, n = _block_and_tile(cols_first)
    layer, e = layer_ref[0], be_ref[b]
    rows, cols = pl.ds(b * bm, bm), pl.ds(n * tn, tn)

    nk = f.layout == "nk"

    @pl.when((e >= 0) & (e < E))
    def _():
        def body(i, acc):
            out = []
            for g in (0, 1):
                out.append(acc[g] + _partial(
                    f, i, tk, tn, n, lambda ks: x_ref[rows, ks], lambda kb: xs_ref[rows, kb],
                    (lambda ks, g=g: q_ref[layer, e, g, cols, ks]) if nk else (
                        lambda ks, g=g: q_ref[layer, e, ks, g, cols]),
                    (lambda ki, ci, g=g: s_ref[layer, e, g, ci, ki]) if nk else (
                        lambda ki, ci, g=g: s_ref[layer, e, ki, g, ci]), asm, swap))
            return tuple(out)

        zero = jnp.zeros((tn, bm) if swap else (bm, tn), jnp.float32)
        gate, up = jax.lax.fori_loop(0, K // tk, body, (zero, zero))
        if f.kind == "int8":  # the per-column scale, after the K loop
            gate = gate * s_ref[layer, e, pl.ds(0, 1), 0, cols]
            up = up * s_ref[layer, e, pl.ds(0, 1), 1, cols]
        h = swiglu(gate, up, limit)
        if swap:
            h = h.T
        if quant_h:  # DeepSeek's act_quant of this row group in the epilogue
            amax = jnp.max(jnp.abs(h), axis=1)
            hscale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
            h_ref[rows, cols] = (h / hscale[:, None]).astype(h_ref.dtype)
            hs[0][rows, n] = hscale
        else:
            h_ref[rows, cols] = h.astype(h_ref.dtype)


def swiglu(gate, up, limit):
    """silu(gate) * up; with `limit` (DeepSeek-V4's swiglu_limit) gate <= limit and up in [-limit, limit] first."""
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def _down_kernel(layer_ref, be_ref, h_ref, hs_ref, q_ref, s_ref, y_ref, *, f, bm, tk, tn, K, E, cols_first, asm,
                 swap):
    """y[rows, tile n] = h[rows] @ W_down[e][:, n] for row block b."""
    b, n = _block_and_tile(cols_first)
    layer, e = layer_ref[0], be_ref[b]
    rows, cols = pl.ds(b * bm, bm), pl.ds(n * tn, tn)

    nk = f.layout == "nk"

    @pl.when((e >= 0) & (e < E))
    def _():
        def body(i, acc):
            return acc + _partial(
                f, i, tk, tn, n, lambda ks: h_ref[rows, ks], lambda kb: hs_ref[rows, kb],
                (lambda ks: q_ref[layer, e, cols, ks]) if nk else (lambda ks: q_ref[layer, e, ks, cols]),
                (lambda ki, ci: s_ref[layer, e, ci, ki]) if nk else (lambda ki, ci: s_ref[layer, e, ki, ci]), asm,
                swap)

        acc = jax.lax.fori_loop(0, K // tk, body, jnp.zeros((tn, bm) if swap else (bm, tn), jnp.float32))
        if swap:
            acc = acc.T
        if f.kind == "int8":
            acc = acc * s_ref[layer, e, pl.ds(0, 1), cols]
        y_ref[rows, cols] = acc.astype(y_ref.dtype)


def swappable(f: WeightFormat) -> bool:
    """Whether a kernel over weights in format f can take the weight tile as the MMA's first operand (`swap_ab`):
    FP4 (the decoded tile) and FP8 in the checkpoint's "nk" orientation (its [tn, tk] tile K-major as stored, as
    FP8 tensor cores need both operands)."""
    return f.kind == "fp4" or (f.kind == "fp8" and f.layout == "nk")


def swaps_ab(block_m: int, f: WeightFormat) -> bool:
    """Whether the kernels over weights in format f take the weight tile as the MMA's first operand by default
    (`moe_experts_quant`'s swap_ab None) at this row block: FP4 at decode sizes' 16-row blocks. H100, V4-Flash's
    experts (benchmarks/fp4_experts.py): 1,931 against 2,119 us at 32 tokens, 4,536 against 4,631 at 128; at 4,096
    tokens (128-row blocks) 9,528 against 9,082. FP8 "nk" swaps only when asked (`swap_ab=True`): unmeasured."""
    return block_m < 64 and f.kind == "fp4"


@functools.partial(jax.jit, static_argnames=("fmt_gu", "fmt_down", "block_m", "block_n", "block_k", "num_warps",
                                             "num_stages", "cols_first", "swiglu_limit", "swap_ab", "interpret"))
def moe_experts_quant(x, gu_q, gu_s, down_q, down_s, weights, idx, layer=None, *, fmt_gu, fmt_down, block_m=None,
                      block_n=None, block_k=None, num_warps=None, num_stages=None, cols_first=None,
                      swiglu_limit=None, swap_ab=None, interpret=False):
    """x [T, D], the experts' stored weights (module docstring; stacked [L, E, ..] with `layer` an int32 scalar,
    else [E, ..]), weights / idx [T, k] -> [T, D] in x's dtype. Ids outside [0, E) are skipped. Tiles left as
    None come from `moe_gmm.tile_config(T * k)`, narrowed to what each format allows (`supported`); FP4's block_k
    from `fp4_block_k`. `swap_ab` (FP4 and FP8 "nk", `swappable`; None: `swaps_ab`): the kernels multiply the
    weight tile by x's transposed tile, [tn, bm] products transposed in the epilogue, so the weight tile is the
    MMA's first operand (Hopper's wgmma reads it from registers or shared memory; its M is then the tile's width,
    not a 16-row block)."""
    if swap_ab and not (swappable(fmt_gu) or swappable(fmt_down)):
        raise ValueError("moe_experts_quant: swap_ab applies to FP4 and FP8 \"nk\" weights only")
    if layer is None:
        gu_q, gu_s, down_q, down_s, layer = gu_q[None], gu_s[None], down_q[None], down_s[None], 0
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    T, D = x.shape
    E, I = gu_q.shape[1], gu_q.shape[3 if fmt_gu.layout == "nk" else 4]
    k = idx.shape[-1]
    auto = tile_config(T * k)
    bm, bn, bk, warps, stages = (a if v is None else v
                                 for v, a in zip((block_m, block_n, block_k, num_warps, num_stages), auto))
    bk_gu, bk_down = (fp4_block_k(largest_pow2_divisor(N, bn)) if f.kind == "fp4" and block_k is None else bk
                      for f, N in ((fmt_gu, I), (fmt_down, D)))
    t1, t2 = _tiles(fmt_gu, D, I, bn, bk_gu), _tiles(fmt_down, I, D, bn, bk_down)
    if t1 is None or t2 is None:
        raise ValueError(f"moe_experts_quant: no tiling for D {D}, I {I} in formats {fmt_gu}, {fmt_down}")
    cols_first = cols_first_for(T * k) if cols_first is None else cols_first
    swap_gu, swap_down = ((swaps_ab(bm, f) if swap_ab is None else swap_ab) and swappable(f)
                          for f in (fmt_gu, fmt_down))
    if fmt_gu.kind == "fp4":
        x = split_pairs(x, t1[0])
    row_copy, block_expert, row_of = align_tokens(idx, E, bm)
    m_pad, nb = row_copy.shape[0], block_expert.shape[0]
    tok = jnp.where(row_copy >= 0, row_copy // k, 0)
    act8 = fmt_gu.kind == "fp8" and fmt_gu.act == "fp8"
    if act8:
        xq, xs = quantize_act(x, fmt_gu.group)
        xk, xs = xq[tok], xs[tok]  # [M_pad, D] e4m3, [M_pad, D / bk]
    else:
        xk, xs = x[tok], jnp.zeros((m_pad, 1), jnp.float32)
    down8 = fmt_down.kind == "fp8" and fmt_down.act == "fp8"
    quant_h = down8 and t1[1] == fmt_down.group
    grid = lambda tiles: (tiles, nb) if cols_first else (nb, tiles)  # noqa: E731
    params = compiler_params(warps, stages, interpret)
    # h in e4m3 (quantized in the epilogue), or fp32 where it is quantized beside (no bf16 rounding first)
    h_shape = [jax.ShapeDtypeStruct((m_pad, I), FP8 if quant_h else jnp.float32 if down8 else x.dtype)]
    if quant_h:
        h_shape.append(jax.ShapeDtypeStruct((m_pad, I // fmt_down.group), jnp.float32))
    out = pl.pallas_call(
        functools.partial(_gate_up_kernel, f=fmt_gu, bm=bm, tk=t1[0], tn=t1[1], K=D, E=E, cols_first=cols_first,
                          quant_h=quant_h, limit=swiglu_limit, asm=not interpret,
                          swap=swap_gu),
        grid=grid(I // t1[1]), out_shape=tuple(h_shape), compiler_params=params, interpret=interpret,
    )(layer, block_expert, xk, xs, gu_q, gu_s if fmt_gu.kind == "fp4" else gu_s.astype(jnp.float32))
    if quant_h:
        h, hs = out
    elif down8:  # the gate_up tile is not one activation group: quantize h beside the kernels
        h, hs = quantize_act(out[0], fmt_down.group)
    else:
        h, hs = out[0], jnp.zeros((m_pad, 1), jnp.float32)
    if fmt_down.kind == "fp4":
        h = split_pairs(h, t2[0])
    y = pl.pallas_call(
        functools.partial(_down_kernel, f=fmt_down, bm=bm, tk=t2[0], tn=t2[1], K=I, E=E, cols_first=cols_first,
                          asm=not interpret, swap=swap_down),
        grid=grid(D // t2[1]), out_shape=jax.ShapeDtypeStruct((m_pad, D), x.dtype), compiler_params=params,
        interpret=interpret,
    )(layer, block_expert, h, hs, down_q, down_s if fmt_down.kind == "fp4" else down_s.astype(jnp.float32))
    return combine_rows(y, row_of, weights, T, k, D, x.dtype)


def split_pairs(a: jax.Array, tk: int) -> jax.Array:
    """a [M, K] with each tk-column K step's columns reordered: its even columns, then its odd ones. The FP4 kernels
    read their x / h so, since a step's bytes decode into its even and its odd columns as two tiles (one dot
    each on a contiguous half of x's step, where interleaving them back into K order would cost a layout shuffle
    of the whole weight tile)."""
    M, K = a.shape
    return a.reshape(M, K // tk, tk // 2, 2).swapaxes(-1, -2).reshape(M, K)


def dequant_expert(q, s, f: WeightFormat, n_out: int) -> jax.Array:
    """A stored expert weight [.., K(packed), *out] (n_out output axes; FP8 "nk": [.., (2,) N, K]; FP4: [.., (2,)
    N, K / 2]) back to fp32 [.., K, *out]."""
    if f.kind == "fp4":
        return jnp.moveaxis(fp4_rows(q, s, f.group), -1, -1 - n_out)  # [.., (2,) N, K] -> [.., K, (2,) N]
    if f.layout == "nk":
        w = dequant_fp8(q, s, (f.block_n, f.group))  # [.., (2,) N, K]: rows in bn blocks, columns in bk
        return jnp.moveaxis(w, -1, -1 - n_out)  # K before the output axes: [.., K, (2,) N]
    if f.kind == "int8":
        return q.astype(jnp.float32) * s.astype(jnp.float32)
    ax = q.ndim - n_out - 1  # the K axis
    if f.kind == "int4":
        b = q.astype(jnp.int32)
        v = jnp.stack([(b & 15) - 8, (b >> 4) - 8], axis=ax + 1)  # [.., K / 2, 2, *out]
        v = v.reshape(q.shape[:ax] + (2 * q.shape[ax],) + q.shape[ax + 1:]).astype(jnp.float32)
        return v * jnp.repeat(s.astype(jnp.float32), f.group, axis=ax)
    if n_out == 1:
        return dequant_fp8(q, s, (f.group, f.block_n))
    qt, st = jnp.moveaxis(q, -2, 0), jnp.moveaxis(s, -2, 0)  # gate_up [.., D, 2, I]: the 2 in front
    return jnp.moveaxis(dequant_fp8(qt, st, (f.group, f.block_n)), 0, -2)


def _through_fp8(a, group):
    """a rounded through `quantize_act` (1 x group), back in fp32."""
    aq, s = quantize_act(a, group)
    return aq.astype(jnp.float32) * jnp.repeat(s, group, axis=1)[:, : a.shape[1]]


def moe_experts_quant_reference(x, gu_q, gu_s, down_q, down_s, weights, idx, *, fmt_gu, fmt_down, swiglu_limit=None):
    """Pure JAX over unstacked [E, ..] weights: each copy through its dequantized expert, fp32 throughout, x's
    dtype out (h rounded to x's dtype between the two GEMMs, as the kernels store it; with FP8 activations, x
    and h rounded through `quantize_act` instead)."""
    wgu = dequant_expert(gu_q, gu_s, fmt_gu, 2)[idx]  # [T, k, D, 2, I]
    wd = dequant_expert(down_q, down_s, fmt_down, 1)[idx]  # [T, k, I, D]
    xf = _through_fp8(x, fmt_gu.group) if fmt_gu.act == "fp8" else x.astype(jnp.float32)
    g = jnp.einsum("td,tkdi->tki", xf, wgu[..., 0, :], precision=EXACT)
    u = jnp.einsum("td,tkdi->tki", xf, wgu[..., 1, :], precision=EXACT)
    h = swiglu(g, u, swiglu_limit)  # [T, k, I]
    T, k, I = h.shape
    if fmt_down.act == "fp8":
        h = _through_fp8(h.reshape(T * k, I), fmt_down.group).reshape(T, k, I)
    else:
        h = h.astype(x.dtype).astype(jnp.float32)
    y = jnp.einsum("tki,tkid->tkd", h, wd, precision=EXACT)
    return jnp.einsum("tkd,tk->td", y, weights.astype(jnp.float32)).astype(x.dtype)
