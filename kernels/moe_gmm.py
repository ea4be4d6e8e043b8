"""Fused MoE expert computation: block-aligned grouped GEMMs in Pallas (Triton backend).

The layout is vLLM's fused-MoE one. Token copies (token t, choice j) are sorted by expert and each
expert's group is padded to a multiple of `block_m` rows, so every row block belongs to exactly one
expert (`block_expert[b]`, -1 for unused blocks). Two kernels then run over (row block, column tile):

1. `gate_up`: h[r] = silu(x[r] @ W_gate[e]) * (x[r] @ W_up[e])    [M_pad, D] x [E, D, 2, I] -> [M_pad, I]
2. `down`:    y[r] = h[r] @ W_down[e]                               [M_pad, I] x [E, I, D]    -> [M_pad, D]

Optionally the layer's shared experts join as S more experts (ids E .. E+S-1) that every token uses
with weight 1; their weight tiles come from the shared MLP's own arrays (`moe_experts`).

Each program reads one [K, block_n] tile of its expert's weights once, so at decode sizes (a few rows
per expert) the kernels stream the touched experts' weights, which is the whole cost. The weighted
combine back to tokens gathers each copy's row in JAX. Row tiles follow the number of token copies
(`tile_config`: 16 rows at decode sizes, 64 / 128 at prefill sizes).

Three parts (ARCHITECTURE.md rule 6): `moe_experts` (kernel; `interpret=True` runs it on the CPU) and
`moe_experts_reference` (pure JAX, same result). Invariants: rows of padding carry token index -1 and
contribute nothing; K dims must be multiples of `block_k`, N dims of `block_n`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels import launch_sync
from deepinfer_jax.kernels.triton_params import compiler_params

# fp32 operands multiply in IEEE fp32 (Pallas-Triton's default precision is TF32); bf16 is unaffected.
EXACT = jax.lax.Precision.HIGHEST


# Up to this many token copies (decode sizes) the alignment is compare-and-count over [copies, copies]
# and [rows, copies] grids: a few fused XLA kernels, no sort, no scatter. Above it (prefill sizes)
# those grids grow quadratically, and a stable argsort is cheaper.
COMPARE_ALIGN_MAX_COPIES = 2048


def align_tokens(idx: jax.Array, num_experts: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """idx [T, k] expert ids -> (row_copy [M_pad] int32: copy index t*k+j of each row or -1,
    block_expert [M_pad // block_m] int32: the expert of each row block or -1,
    row_of [T*k] int32: the row of each copy, M_pad for a skipped one).
    An id outside [0, E) (e.g. -1: a copy another device's experts handle under expert parallelism)
    gets no row at all. M_pad = round_up(T*k + E*(block_m - 1), block_m), a static upper bound.
    Copies of one expert keep their order (copy index ascending) in both methods."""
    n = idx.size
    flat = idx.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    flat = jnp.where(valid, flat, num_experts)  # skipped copies go to a pseudo-expert with no blocks
    m_pad = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    copy = jnp.arange(n, dtype=jnp.int32)
    if n <= COMPARE_ALIGN_MAX_COPIES:
        counts = jnp.sum(flat[:, None] == jnp.arange(num_experts + 1)[None, :], axis=0, dtype=jnp.int32)
        # rank of a copy within its expert = earlier copies with the same expert
        rank = jnp.sum((flat[None, :] == flat[:, None]) & (copy[None, :] < copy[:, None]), axis=1, dtype=jnp.int32)
    else:
        counts = jnp.bincount(flat, length=num_experts + 1)  # [E + 1]
    padded = ((counts + block_m - 1) // block_m * block_m).at[num_experts].set(0)
    starts = jnp.cumsum(padded) - padded  # [E + 1] first padded row of each expert
    if n <= COMPARE_ALIGN_MAX_COPIES:
        row_of = jnp.where(valid, starts[flat] + rank, m_pad).astype(jnp.int32)  # [n]
        hit = row_of[None, :] == jnp.arange(m_pad, dtype=jnp.int32)[:, None]  # [M_pad, n], <= 1 per row
        row_copy = jnp.sum(jnp.where(hit, copy[None, :] + 1, 0), axis=1, dtype=jnp.int32) - 1
    else:
        order = jnp.argsort(flat, stable=True)  # [n] copies sorted by expert, skipped ones last
        sorted_e = flat[order]
        group_first = jnp.cumsum(counts) - counts  # first sorted position of each expert
        rank = jnp.arange(n) - group_first[sorted_e]
        dest = jnp.where(sorted_e < num_experts, starts[sorted_e] + rank, m_pad)  # skipped: out of range
        row_copy = jnp.full((m_pad,), -1, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
        row_of = jnp.full((n,), m_pad, jnp.int32).at[order].set(dest.astype(jnp.int32))
    block_start = jnp.arange(m_pad // block_m) * block_m
    ends = jnp.cumsum(padded[:num_experts])  # [E]
    # The expert of a block = how many experts' padded groups end at or before its start. A compare-and-
    # count is one fused kernel; jnp.searchsorted lowers to a while loop of small kernels on the GPU.
    block_expert = jnp.sum(block_start[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)
    block_expert = jnp.where(block_start < ends[-1], block_expert, -1)
    return row_copy, block_expert, row_of


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """The static shape of one expert kernel: row block, column tile, K step, K (the contraction), E
    (routed experts), I (an expert's width) and the copies a token has (for the row gathers)."""
    block_m: int
    block_n: int
    block_k: int
    K: int
    E: int
    I: int
    copies_per_token: int


def _expert_tile(t: _Tiles, b, be_ref, routed, shared, after=None):
    """Run program (row block b, one column tile) of an expert kernel: `routed(rows, e)` for a routed
    expert's block, `shared(rows, s)` for a shared expert's (e = E + s); nothing for an unused block (-1).
    `after()` runs once the tile's output is stored.

    (A shared expert's T rows take T / 16 programs that each read its weights: one 32-row program at batch 32
    made the step slower, 8.29 ms against 8.20 on an H200, and 64-row ones at batch 128, 11.54 against 11.39.
    Our reading, not measured: a shared expert's 16-row programs start close together, so most of its repeated
    reads come from L2.)"""
    e = be_ref[b]
    rows = pl.ds(b * t.block_m, t.block_m)
    for run, hit, j in ((routed, (e >= 0) & (e < t.E), e), (shared, e >= t.E, e - t.E)):
        if run is None:
            continue

        @pl.when(hit)
        def _(run=run, j=j):
            run(rows, j)
            if after is not None:
                after()


def gate_up_rows(t: _Tiles, load_x, tile, h_ref, rows, cols) -> None:
    """h[rows, cols] = silu(x @ W_gate[:, cols]) * (x @ W_up[:, cols]) over K = t.K in t.block_k steps:
    load_x(ks) -> the rows' x [bm, bk], tile(ks, g) -> the gate (g = 0) or up (g = 1) weight tile [bk, bn]."""

    def body(i, acc):
        g, u = acc
        ks = pl.ds(i * t.block_k, t.block_k)
        x = load_x(ks)  # [bm, bk]
        dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=EXACT)
        return g + dot(x, tile(ks, 0)), u + dot(x, tile(ks, 1))  # [bm, bk] x [bk, bn]

    zero = jnp.zeros((t.block_m, t.block_n), jnp.float32)
    g, u = jax.lax.fori_loop(0, t.K // t.block_k, body, (zero, zero))
    h_ref[rows, cols] = (jax.nn.silu(g) * u).astype(h_ref.dtype)


def down_rows(t: _Tiles, h_ref, tile, y_ref, rows, cols) -> None:
    """y[rows, cols] = h[rows] @ W_down[:, cols] over K = t.K in t.block_k steps: tile(i) -> the i-th K tile
    of the weights [bk, bn]."""

    def body(i, acc):
        h = h_ref[rows, pl.ds(i * t.block_k, t.block_k)]
        return acc + jnp.dot(h, tile(i), preferred_element_type=jnp.float32, precision=EXACT)

    acc = jax.lax.fori_loop(0, t.K // t.block_k, body, jnp.zeros((t.block_m, t.block_n), jnp.float32))
    y_ref[rows, cols] = acc.astype(y_ref.dtype)


def gate_up_tile(t: _Tiles, b, n, layer_ref, be_ref, x_ref, w_ref, sw_ref, rc_ref, h_ref, gathered, after=None):
    """h[rows, tile n] = silu(x[rows] @ W_gate[e][:, n]) * (x[rows] @ W_up[e][:, n]) for row block b."""
    layer = layer_ref[0]
    cols = pl.ds(n * t.block_n, t.block_n)

    def run(rows, tile):  # tile(ks, g) -> [bk, bn]: the gate (g = 0) or up (g = 1) weight tile
        if gathered:  # x_ref holds the rows already gathered [M_pad, D]
            load_x = lambda ks: x_ref[rows, ks]  # noqa: E731
        else:  # x_ref is x [T, D]: each row reads its copy's token (padding rows token 0)
            rc = rc_ref[rows]
            tok = jnp.where(rc >= 0, rc // t.copies_per_token, 0)  # [bm]
            load_x = lambda ks: x_ref[tok, ks]  # noqa: E731
        gate_up_rows(t, load_x, tile, h_ref, rows, cols)

    routed = lambda rows, e: run(rows, lambda ks, g: w_ref[layer, e, ks, g, cols])  # noqa: E731
    shared = None if sw_ref is None else (  # columns s*I .. s*I + I of the shared MLP
        lambda rows, s: run(rows, lambda ks, g: sw_ref[layer, ks, g, pl.ds(s * t.I + n * t.block_n, t.block_n)]))
    _expert_tile(t, b, be_ref, routed, shared, after)


def down_tile(t: _Tiles, b, n, layer_ref, be_ref, h_ref, w_ref, sw_ref, y_ref, before=None):
    """y[rows, tile n] = h[rows] @ W_down[e][:, n] for row block b; `before()` runs first (a wait)."""
    layer = layer_ref[0]
    cols = pl.ds(n * t.block_n, t.block_n)

    def run(rows, tile):  # tile(i) -> [bk, bn]: the i-th K tile of this expert's down weights
        if before is not None:
            before()
        down_rows(t, h_ref, tile, y_ref, rows, cols)

    routed = lambda rows, e: run(rows, lambda i: w_ref[layer, e, pl.ds(i * t.block_k, t.block_k), cols])  # noqa: E731
    shared = None if sw_ref is None else (  # rows s*I .. s*I + I of the shared down weights
        lambda rows, s: run(rows, lambda i: sw_ref[layer, pl.ds(s * t.I + i * t.block_k, t.block_k), cols]))
    _expert_tile(t, b, be_ref, routed, shared)


def _refs(refs, shared, with_rc):
    """Split a kernel's trailing refs: (shared weights or None, row_copy or None, the rest)."""
    refs = list(refs)
    sw = refs.pop(0) if shared else None
    rc = refs.pop(0) if with_rc else None
    return sw, rc, refs


def _block_and_tile(cols_first: bool):
    """(row block b, column tile n) of this program; grid axis 0 is the one launched fastest."""
    first = pl.program_id(0)
    return (pl.program_id(1), first) if cols_first else (first, pl.program_id(1))


def _gate_up_kernel(layer_ref, be_ref, x_ref, w_ref, *refs, t: _Tiles, shared, with_rc, gathered, cols_first):
    sw_ref, rc_ref, (h_ref,) = _refs(refs, shared, with_rc)
    b, n = _block_and_tile(cols_first)
    gate_up_tile(t, b, n, layer_ref, be_ref, x_ref, w_ref, sw_ref, rc_ref, h_ref, gathered)


def _down_kernel(layer_ref, be_ref, h_ref, w_ref, *refs, t: _Tiles, shared, cols_first):
    sw_ref, _, (y_ref,) = _refs(refs, shared, False)
    b, n = _block_and_tile(cols_first)
    down_tile(t, b, n, layer_ref, be_ref, h_ref, w_ref, sw_ref, y_ref)


def _single_launch_kernel(layer_ref, be_ref, x_ref, wgu_ref, wd_ref, *refs, t1: _Tiles, t2: _Tiles, shared, with_rc,
                          gathered, n1, spin):
    """Both expert kernels in one launch (`moe_experts_aligned(single_launch=True)`): programs 0 .. n1 - 1
    are gate_up tiles, block-major (block b's column tiles are programs b * tiles1 ..); the rest are down
    tiles, block-major too. A gate_up program, once its tile of h is stored, adds 1 to ready[b]; a down
    program of block b first waits until ready[b] == tiles1 (all of its block's h). No deadlock: CUDA
    starts a 1-D grid's programs in order, so every gate_up program has started (and will finish) before
    any down program waits. The down programs of early blocks thus start while the last gate_up tiles
    still stream, with no kernel boundary between the two. ready [nb]: a zeroed int32 array, aliased."""
    refs = list(refs)
    sgu_ref, sd_ref = (refs.pop(0), refs.pop(0)) if shared else (None, None)
    rc_ref = refs.pop(0) if with_rc else None
    _ready_in, h_ref, y_ref, ready_ref = refs
    p = pl.program_id(0)
    tiles1, tiles2 = t1.I // t1.block_n, y_ref.shape[1] // t2.block_n  # column tiles of h, of y

    @pl.when(p < n1)
    def _():
        b = p // tiles1
        gate_up_tile(t1, b, p % tiles1, layer_ref, be_ref, x_ref, wgu_ref, sgu_ref, rc_ref, h_ref, gathered,
                 after=lambda: launch_sync.release(ready_ref, b, spin))

    @pl.when(p >= n1)
    def _():
        b, n = (p - n1) // tiles2, (p - n1) % tiles2
        down_tile(t2, b, n, layer_ref, be_ref, h_ref, wd_ref, sd_ref, y_ref,
              before=lambda: launch_sync.acquire(ready_ref, b, tiles1, spin))


def fit_tile(block: int, dim: int) -> int:
    """The largest power-of-two tile <= `block` that divides `dim` (e.g. 704 = I/2 under TP=2 -> 64; 96 -> 32)."""
    b = 1 << (min(block, dim).bit_length() - 1)  # a power of two even where dim < block is not one
    while b > 16 and dim % b:
        b //= 2
    if dim % b:
        raise ValueError(f"no tile of at least 16 divides the dimension {dim}")
    return b


def single_launch_tiles(num_copies: int, D: int, E: int, I: int, K: int, block_m: int, dtype) -> tuple:
    """(t1, t2, num_warps, num_stages): the gate_up and down tiles and the compiler parameters of a launch that
    runs both expert kernels (`single_launch`, kernels/route_experts.py) at `tile_config(num_copies)`'s sizes;
    one stage for fp32 operands (twice the bytes a tile)."""
    _, block_n, block_k, num_warps, num_stages = tile_config(num_copies)
    t1 = _Tiles(block_m, fit_tile(block_n, I), fit_tile(block_k, D), D, E, I, K)
    t2 = _Tiles(block_m, fit_tile(block_n, D), fit_tile(block_k, I), I, E, I, K)
    return t1, t2, num_warps, 1 if jnp.dtype(dtype).itemsize >= 4 else num_stages


def _call(kernel, grid, out_shape, args, num_warps, num_stages, interpret, **kw):
    params = compiler_params(num_warps, num_stages, interpret)
    return pl.pallas_call(
        functools.partial(kernel, **kw), grid=grid, out_shape=out_shape,
        compiler_params=params, interpret=interpret,
    )(*args)


def tile_config(num_copies: int) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, num_warps, num_stages) by the number of token copies T*k, from the
    H200 sweeps in benchmarks/RESULTS.md: decode sizes stream weights (small row blocks, little
    padding); prefill sizes are compute-bound (128-row blocks: 306 TFLOP/s at 8,192 tokens vs 270
    with 64). A block_n that does not divide a kernel's N dim is halved by `fit_tile`: 256 applies to the
    down kernel's D = 2048 while the gate_up kernel keeps 128 for I = 1408."""
    if num_copies < 256:  # batches up to 31 (V2-Lite's 8 copies a token): 128-wide tiles keep ~128+ programs
        return 16, 128, 64, 4, 3
    if num_copies < 1024:  # batch 32 (256 copies): 8.64 ms a step against 8.69 (H200)
        return 16, 256, 64, 4, 4
    if num_copies < 2048:  # 256 tokens x top-6: 500 us with 256-wide down tiles vs 583 with 128
        return 16, 256, 64, 4, 3
    if num_copies < 16384:
        return 64, 128, 64, 4, 3
    return 128, 128, 64, 8, 4


def down_tile_config(num_copies: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages) of the down kernel where it has a launch of its own: the
    gate_up kernel's (`tile_config`) except at prefill sizes, where 256-wide column tiles halve the reads of
    each row block (H200, 16,384 tokens x top-6, `kernels.py --only moe_prefill`: 919 us against 1,073 with
    128 x 64 tiles at 4 stages, 617 against 528 TFLOP/s; the gate_up kernel's two accumulators leave no room
    for 256-wide tiles there)."""
    if num_copies >= 16384:
        return 256, 64, 8, 3
    return tile_config(num_copies)[1:]


# The Mosaic GPU experts (RunnerConfig.moe_prefill_mosaic) from this many token copies: prefill sizes, where
# tile_config's row blocks are 128 (the kernels' tile_m; each compute warpgroup takes 64 rows of gate_up's tile) and
# the GEMMs compute-bound. On an H100 a step's experts were 8-15% faster at 2,731-16,384 tokens x top-6.
MOSAIC_MIN_COPIES = 16384


def mosaic_applies(num_copies: int, D: int, I: int, block_m: int, dtype, shared: bool, interpret: bool = False) -> bool:
    """Whether kernels/moe_gmm_mgpu.py takes a step's experts: prefill sizes, 16-bit weights, no shared experts
    inside the kernels, its tiles dividing the shapes (128-row blocks, I by 128, D by 256 columns), and a Hopper
    GPU (wgmma; sm_90) to run on, or Mosaic GPU's interpreter."""
    return (num_copies >= MOSAIC_MIN_COPIES and jnp.dtype(dtype).itemsize == 2 and not shared
            and block_m % 128 == 0 and I % 128 == 0 and D % 256 == 0 and (interpret or _hopper()))


def _hopper() -> bool:
    """The default device is a Hopper GPU (compute capability 9.x), which the Mosaic kernels' wgmma needs."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def gather_in_kernel_for(num_copies: int) -> bool:
    """Whether the gate_up kernel reads its rows' tokens from x itself at this size (no [M_pad, D] copy of the
    rows first). At Protocol A's prefill (16,384 tokens x top-6 on an H200, `kernels.py --only moe_prefill`) the
    gather costs the kernel 73 us and saves XLA's 286 us copy; at 8,192 tokens the two were even.
    Decode sizes gather in the kernel through `moe_route.moe_fused_decode`."""
    return num_copies >= 65536


def cols_first_for(num_copies: int) -> bool:
    """Launch order of the expert kernels by the number of token copies: column tiles first at prefill
    sizes, where every row block is re-read once per column tile (benchmarks/RESULTS.md)."""
    return num_copies >= COMPARE_ALIGN_MAX_COPIES


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages",
                                             "cols_first", "gather_in_kernel", "mosaic", "interpret"))
def moe_experts(x, w_gate_up, w_down, weights, idx, layer=None, *, shared_gate_up=None, shared_down=None,
                block_m=None, block_n=None, block_k=None, num_warps=None, num_stages=None, cols_first=None,
                gather_in_kernel=None, mosaic=False, interpret=False):
    """x [T, D], w_gate_up [E, D, 2, I], w_down [E, I, D], weights/idx [T, k] -> [T, D] (x's dtype).
    `mosaic`: where `mosaic_applies`, the two expert GEMMs run on Mosaic GPU (kernels/moe_gmm_mgpu.py).
    Copies whose id is outside [0, E) are skipped (they contribute nothing and cost no work).
    Tiles left as None come from `tile_config(T * k)` (T * (k + S) with shared experts).

    With `layer` (int32 scalar), the weights are stacked over layers ([L, E, D, 2, I], [L, E, I, D])
    and the kernels read layer `layer` in place (no copy of the slice).

    shared_gate_up [(L,) D, 2, S*I] and shared_down [(L,) S*I, D] (stacked like the routed weights):
    DeepSeek's shared MLP, of width n_shared x moe_intermediate, added to the output. It runs as S more
    experts of width I that every token uses with weight 1: its SwiGLU splits exactly into S slices of
    the intermediate dim, whose down projections sum to the whole. The kernels read the shared weights
    in place too, so the layer's shared and routed weights stream in the same two kernels."""
    if layer is None:
        w_gate_up, w_down, layer = w_gate_up[None], w_down[None], 0
        if shared_gate_up is not None:
            shared_gate_up, shared_down = shared_gate_up[None], shared_down[None]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    T, D = x.shape
    _, E, _, _, I = w_gate_up.shape
    shared = ()
    num_experts = E
    if shared_gate_up is not None:
        S, rem = divmod(shared_gate_up.shape[-1], I)
        if rem:
            raise ValueError(f"the shared MLP's width {shared_gate_up.shape[-1]} is not a multiple of the experts' {I}")
        idx = jnp.where((idx >= 0) & (idx < E), idx, -1)  # ids >= E would read as shared experts
        idx = jnp.concatenate([idx, jnp.broadcast_to(E + jnp.arange(S, dtype=idx.dtype), (T, S))], axis=1)
        weights = jnp.concatenate([weights.astype(jnp.float32), jnp.ones((T, S), jnp.float32)], axis=1)
        num_experts = E + S
        shared = (shared_gate_up, shared_down)
    block_m = tile_config(idx.size)[0] if block_m is None else block_m
    row_copy, block_expert, row_of = align_tokens(idx, num_experts, block_m)
    return moe_experts_aligned(x, w_gate_up, w_down, weights, row_copy, block_expert, row_of, layer, *shared,
                               block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                               num_stages=num_stages, cols_first=cols_first, gather_in_kernel=gather_in_kernel,
                               mosaic=mosaic and mosaic_applies(idx.size, D, I, block_m, x.dtype, bool(shared),
                                                                interpret),
                               interpret=interpret)


def moe_experts_aligned(x, w_gate_up, w_down, weights, row_copy, block_expert, row_of, layer,
                        shared_gate_up=None, shared_down=None, *, block_m, block_n=None, block_k=None,
                        num_warps=None, num_stages=None, cols_first=None, gather_in_kernel=None,
                        single_launch=False, down_tiles=None, mosaic=False, interpret=False):
    """The two kernels and the combine, given the alignment (`align_tokens`' layout, any M_pad that is a
    multiple of block_m): x [T, D], weights [T, K] (K copies a token, shared ones included), stacked
    weights [L, ...] read at `layer` (int32 [1]) -> [T, D]. Tiles left as None come from tile_config.
    gather_in_kernel: the gate_up kernel reads each row's token from x itself (no [M_pad, D] copy); None:
    `gather_in_kernel_for(T * K)`.
    cols_first: launch a row block's column tiles one after another (its rows stay in L2 while the
    expert's weight tiles stream) instead of a column tile's row blocks (each tile's weights stay in
    L2 while all the rows stream once per column tile); None: `cols_first_for(T * K)`.
    single_launch: both kernels in one launch, the down tiles of a row block waiting on its gate_up tiles
    (`_single_launch_kernel`; block-major order, `cols_first` ignored).
    down_tiles: (block_n, block_k, num_warps, num_stages) of the down kernel where it has a launch of its
    own; None: `down_tile_config(T * K)`, or the gate_up kernel's where the tiles above were given.
    mosaic: the gate_up SwiGLU and the down GEMM on Mosaic GPU (kernels/moe_gmm_mgpu.py, tile_m = block_m) over
    XLA's gather of the rows, instead of the two Triton kernels; the caller checks `mosaic_applies`."""
    T, D = x.shape
    _, E, _, _, I = w_gate_up.shape
    K = weights.shape[-1]
    auto = tile_config(T * K)
    cols_first = cols_first_for(T * K) if cols_first is None else cols_first
    gather_in_kernel = gather_in_kernel_for(T * K) if gather_in_kernel is None else gather_in_kernel
    given = (block_n, block_k, num_warps, num_stages)
    block_n, block_k, num_warps, num_stages = (a if v is None else v for v, a in zip(given, auto[1:]))
    if down_tiles is None:
        down_tiles = (block_n, block_k, num_warps, num_stages) if any(v is not None for v in given) else (
            down_tile_config(T * K))
    if x.dtype.itemsize >= 4:  # fp32 tiles are twice the bytes: one stage fits in shared memory
        num_stages = 1
        down_tiles = (*down_tiles[:3], 1)
    shared = () if shared_gate_up is None else (shared_gate_up.astype(x.dtype), shared_down.astype(x.dtype))
    m_pad, nb = row_copy.shape[0], block_expert.shape[0]
    gather_in_kernel = gather_in_kernel and not mosaic  # TMA has no row gather on Hopper
    xs = x if gather_in_kernel else x[jnp.where(row_copy >= 0, row_copy // K, 0)]  # [M_pad, D] gathered
    rc1 = (row_copy,) if gather_in_kernel else ()  # each row's token, read in the kernel
    wgu, wd = w_gate_up.astype(x.dtype), w_down.astype(x.dtype)
    if mosaic:
        from deepinfer_jax.kernels import moe_gmm_mgpu

        L = w_gate_up.shape[0]
        ids = jnp.where(block_expert >= 0, block_expert + layer[0] * E, -1)  # into the [L * E, ...] experts
        h = moe_gmm_mgpu.grouped_swiglu(xs, wgu.reshape(L * E, D, 2 * I), ids, tile_m=block_m, interpret=interpret)
        y = moe_gmm_mgpu.grouped_matmul(h, wd.reshape(L * E, I, D), ids, tile_m=block_m, interpret=interpret)
        return combine_rows(y, row_of, weights, T, K, D, x.dtype)
    if single_launch:  # one launch, one set of compiler parameters
        down_tiles = (block_n, block_k, num_warps, num_stages)
    bn1, bn2 = fit_tile(block_n, I), fit_tile(down_tiles[0], D)
    t1 = _Tiles(block_m, bn1, fit_tile(block_k, D), D, E, I, K)
    t2 = _Tiles(block_m, bn2, fit_tile(down_tiles[1], I), I, E, I, K)
    if single_launch:
        n1, n2 = nb * (I // bn1), nb * (D // bn2)
        args = (layer, block_expert, xs, wgu, wd, *shared, *rc1, jnp.zeros((nb,), jnp.int32))  # ready [nb]
        params = compiler_params(num_warps, num_stages, interpret)
        out = pl.pallas_call(
            functools.partial(_single_launch_kernel, t1=t1, t2=t2, shared=bool(shared), with_rc=bool(rc1),
                              gathered=not gather_in_kernel, n1=n1, spin=not interpret),
            grid=(n1 + n2,),
            out_shape=(jax.ShapeDtypeStruct((m_pad, I), x.dtype), jax.ShapeDtypeStruct((m_pad, D), x.dtype),
                       jax.ShapeDtypeStruct((nb,), jnp.int32)),
            input_output_aliases={len(args) - 1: 2}, compiler_params=params, interpret=interpret,
        )(*args)
        return combine_rows(out[1], row_of, weights, T, K, D, x.dtype)
    grid = lambda n_tiles: (n_tiles, nb) if cols_first else (nb, n_tiles)  # noqa: E731
    h = _call(_gate_up_kernel, grid(I // bn1), jax.ShapeDtypeStruct((m_pad, I), x.dtype),
              (layer, block_expert, xs, wgu, *shared[:1], *rc1), num_warps, num_stages, interpret, t=t1,
              shared=bool(shared), with_rc=bool(rc1), gathered=not gather_in_kernel, cols_first=cols_first)
    y = _call(_down_kernel, grid(D // bn2), jax.ShapeDtypeStruct((m_pad, D), x.dtype),
              (layer, block_expert, h, wd, *shared[1:]), *down_tiles[2:], interpret, t=t2,
              shared=bool(shared), cols_first=cols_first)
    return combine_rows(y, row_of, weights, T, K, D, x.dtype)


def combine_rows(y, row_of, weights, T, K, D, dtype):
    """The expert rows y [M_pad, D] back to tokens [T, D]: each copy's row gathered (no scatter-add of
    [M_pad, D] rows; row_of[c] is the row of copy c, or M_pad for a skipped copy, which reads zeros),
    weighted and summed in fp32."""
    yc = jnp.take(y, row_of, axis=0, mode="fill", fill_value=0).reshape(T, K, D)  # [T, K, D]
    out = jnp.einsum("tkd,tk->td", yc.astype(jnp.float32), weights.astype(jnp.float32))
    return out.astype(dtype)


def moe_experts_reference(x, w_gate_up, w_down, weights, idx):
    """Pure JAX: each token copy through its expert, weighted, summed (fp32 accumulation)."""
    wg = w_gate_up[idx]  # [T, k, D, 2, I]
    g = jnp.einsum("td,tkdi->tki", x, wg[..., 0, :], preferred_element_type=jnp.float32, precision=EXACT)
    u = jnp.einsum("td,tkdi->tki", x, wg[..., 1, :], preferred_element_type=jnp.float32, precision=EXACT)
    h = (jax.nn.silu(g) * u).astype(x.dtype)
    y = jnp.einsum("tki,tkid->tkd", h, w_down[idx], preferred_element_type=jnp.float32, precision=EXACT)
    return jnp.einsum("tkd,tk->td", y, weights.astype(jnp.float32)).astype(x.dtype)
