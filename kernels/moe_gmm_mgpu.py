"""The prefill experts' grouped GEMMs on Mosaic GPU (Pallas' wgmma + TMA backend), warp-specialized.

    grouped_matmul (down):    x [R, K], w [G, K, N]      -> y [R, N],  y[b] = x[b] @ w[g]
    grouped_swiglu (gate_up): x [R, K], w [G, K, 2 * I]  -> h [R, I],  h[b] = silu(x[b] @ W_gate[g]) * (x[b] @ W_up[g])
    for each row block b with g = block_expert[b] >= 0 (block_expert [R // tile_m] int32; W_gate / W_up the two
    halves of w's columns, moe_gmm's [.., D, 2, I] gate_up weights reshaped)

The layout is `moe_gmm.align_tokens`' (vLLM's fused-MoE one) at block_m = tile_m: every row block belongs to one
expert, so every tile multiplies one expert's weights and is stored whole (no laddered store as in jax's
`ragged_dot_mgpu`). A layer of stacked weights [L, E, K, N] is passed as [L * E, K, N] (a free reshape) with the
block ids offset by layer * E. Rows of blocks with id -1 are not written (their contents are undefined).

Why (benchmarks/RESULTS.md, one H100 at Protocol A's prefill, 98,304 rows): our Triton experts reach
577-592 TFLOP/s, jax's warp-specialized dense example 745-772, cuBLAS 799-813. These kernels are that example's
structure with the grouping added: per SM a persistent loop over (row block, column tile); one memory warpgroup
streams [tile_m, tile_k] of x and [tile_k, n] column tiles of w[g] (two in the SwiGLU form: the gate's and the
up's) by TMA through `steps` shared-memory stages; two compute warpgroups accumulate with wgmma in fp32 registers
(the plain form splits the CTA's 2 x tile_n columns between them, the SwiGLU form its tile_m rows, each with a gate
and an up accumulator), then store in 64 x 64 epilogue tiles through shared memory by TMA, the SwiGLU applied to
the accumulators first.

Not yet measured on a GPU, and not yet in the model: the gather of x's rows (TMA has no row gather on Hopper) stays
outside. Three parts (ARCHITECTURE.md rule 6): the kernels (`interpret=True` runs them in Mosaic GPU's interpreter
on the CPU) and `grouped_matmul_reference` / `grouped_swiglu_reference` (pure JAX). Invariants: R % tile_m == 0,
K % tile_k == 0, the output columns a multiple of the CTA's tile; bf16 or fp16 operands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

EPILOGUE = 64  # the epilogue's tile (rows and columns) in shared memory


def grouped_matmul_reference(x: jax.Array, w: jax.Array, block_expert: jax.Array, tile_m: int) -> jax.Array:
    """Pure JAX: each row block times its expert's weights, fp32 accumulation, x's dtype out; skipped blocks 0."""
    R, K = x.shape
    xb = x.reshape(R // tile_m, tile_m, K).astype(jnp.float32)
    wb = w[jnp.maximum(block_expert, 0)].astype(jnp.float32)               # [blocks, K, N]
    y = jnp.einsum("bmk,bkn->bmn", xb, wb, precision=lax.Precision.HIGHEST)
    y = jnp.where((block_expert >= 0)[:, None, None], y, 0.0)
    return y.reshape(R, -1).astype(x.dtype)


def grouped_swiglu_reference(x: jax.Array, w: jax.Array, block_expert: jax.Array, tile_m: int) -> jax.Array:
    """Pure JAX: h = silu(x @ W_gate) * (x @ W_up) per row block, W_gate / W_up the halves of w [G, K, 2 * I]."""
    y = grouped_matmul_reference(x.astype(jnp.float32), w, block_expert, tile_m)   # f32 [R, 2 * I]
    half = w.shape[2] // 2
    return (jax.nn.silu(y[:, :half]) * y[:, half:]).astype(x.dtype)


_STATIC = ("tile_m", "tile_n", "tile_k", "steps", "minor", "width", "num_programs", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_matmul(x, w, block_expert, *, tile_m=128, tile_n=128, tile_k=64, steps=4, minor="m", width=8,
                   num_programs=None, interpret=False) -> jax.Array:
    """The kernel (module docstring): y = x @ w[g] per row block. Tiles: tile_m rows (= align_tokens' block_m),
    2 x tile_n columns a CTA (one tile_n half a compute warpgroup), tile_k deep, `steps` pipeline stages; the (row
    block, column tile) pairs are walked in bands `width` wide along the `minor` dimension (plgpu.planar_snake;
    "m": bands of row blocks, each walking all column tiles while its rows stay in L2; "n": bands of column tiles,
    each walking all row blocks while its weight columns stay in L2, most of an expert's blocks being adjacent).
    `num_programs` CTAs (default: the device's SMs)."""
    return _launch(x, w, block_expert, swiglu=False, cols=w.shape[2], tile_m=tile_m, tile_n=tile_n, tile_k=tile_k,
                   steps=steps, minor=minor, width=width, num_programs=num_programs, interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_swiglu(x, w, block_expert, *, tile_m=128, tile_n=128, tile_k=64, steps=4, minor="m", width=8,
                   num_programs=None, interpret=False) -> jax.Array:
    """The gate_up form: w [G, K, 2 * I] (moe_gmm's [.., D, 2, I] reshaped), h [R, I] = silu(x @ W_gate[g]) *
    (x @ W_up[g]) per row block, W_gate / W_up the two halves of w's columns. A CTA takes a [tile_m, tile_n] tile
    of h: each compute warpgroup half its rows, with two accumulators (the gate and up columns), and the SwiGLU in
    its epilogue; the memory warpgroup streams x's rows and both halves' column tiles."""
    assert w.shape[2] % 2 == 0, w.shape
    return _launch(x, w, block_expert, swiglu=True, cols=w.shape[2] // 2, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k,
                   steps=steps, minor=minor, width=width, num_programs=num_programs, interpret=interpret)


def _launch(x, w, block_expert, *, swiglu, cols, tile_m, tile_n, tile_k, steps, minor, width, num_programs,
            interpret):
    """One persistent launch over (row block, column tile) pairs; `cols` output columns. The plain form's CTA tile
    is [tile_m, 2 x tile_n] (the warpgroups split the columns), the SwiGLU form's [tile_m, tile_n] over two
    weight column tiles (the warpgroups split the rows)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    R, K = x.shape
    K2 = w.shape[1]
    cta_n = tile_n if swiglu else 2 * tile_n
    wg_m = tile_m // 2 if swiglu else tile_m  # rows a compute warpgroup holds
    assert K == K2 and R % tile_m == 0 and cols % cta_n == 0 and K % tile_k == 0, (x.shape, w.shape)
    assert block_expert.shape == (R // tile_m,), (block_expert.shape, R, tile_m)
    assert wg_m % EPILOGUE == 0 and tile_n % EPILOGUE == 0
    m_iters, n_iters, k_iters = R // tile_m, cols // cta_n, K // tile_k
    bits = jnp.dtype(x.dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(tile_k * bits)
    transforms = (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(EPILOGUE * bits)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle * 8 // bits)), plgpu.SwizzleTransform(out_swizzle))
    minor_dim = 0 if minor == "m" else 1  # plgpu.planar_snake's minor dimension
    w_spec = plgpu.BlockSpec((tile_k, cta_n), lambda k: (k, 0), transforms=transforms, memory_space=plgpu.SMEM)

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((tile_m, tile_k), lambda k: (0, k), transforms=transforms,
                                      memory_space=plgpu.SMEM)] + [w_spec] * (2 if swiglu else 1),
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=steps, compute_context=context)

    def body(be_gmem, x_gmem, w_gmem, y_gmem):
        ignore = lambda *_, **__: None  # noqa: E731  the allocations do not depend on the bodies
        w_tile = w_gmem.at[0, :, pl.ds(0, cta_n)]
        allocs = pipeline(ignore, ignore).get_allocations(x_gmem, *[w_tile] * (2 if swiglu else 1))

        @functools.partial(pl.run_scoped, allocs=allocs,
                           out_smem=plgpu.SMEM((2, 2, EPILOGUE, EPILOGUE), y_gmem.dtype, transforms=out_transforms),
                           collective_axes="wg")
        def scope(allocs, out_smem):
            wg = lax.axis_index("wg")
            # the warpgroup's part of the CTA tile: rows (SwiGLU) or columns (plain)
            wg_rows = pl.ds(wg * wg_m, wg_m) if swiglu else slice(None)
            wg_cols = slice(None) if swiglu else pl.ds(wg * tile_n, tile_n)

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def tile_loop(info):
                m_idx, n_idx = plgpu.planar_snake(info.index[0], (m_iters, n_iters), minor_dim, width)
                g = be_gmem[m_idx]
                m_rows, n_cols = pl.ds(m_idx * tile_m, tile_m), pl.ds(n_idx * cta_n, cta_n)

                def store(result):  # [wg_m, tile_n] -> y's tile of this warpgroup, in epilogue tiles via smem
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    tiles_n = tile_n // EPILOGUE
                    for i in range(wg_m // EPILOGUE):
                        for j in range(tiles_n):
                            rows = slice(i * EPILOGUE, (i + 1) * EPILOGUE)
                            cols_ = slice(j * EPILOGUE, (j + 1) * EPILOGUE)
                            slot = (i * tiles_n + j) % 2
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            out_smem[wg, slot] = result[rows, cols_]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot],
                                                    y_gmem.at[m_rows, n_cols].at[wg_rows, wg_cols].at[rows, cols_])

                def context(eval_pipeline):
                    accs = [plgpu.ACC((wg_m, tile_n), jnp.float32)] * (2 if swiglu else 1)

                    @functools.partial(pl.run_scoped, accs=accs)
                    def acc_scope(accs):
                        eval_pipeline(accs)
                        if swiglu:
                            gate, up = accs[0][...], accs[1][...]
                            store((gate / (1.0 + jnp.exp(-gate)) * up).astype(y_gmem.dtype))
                        else:
                            store(accs[0][...].astype(y_gmem.dtype))

                def mma(idxs, x_smem, *w_and_accs):
                    *w_smems, accs = w_and_accs
                    for w_smem, acc in zip(w_smems, accs):
                        plgpu.wgmma(acc, x_smem.at[wg_rows], w_smem.at[:, wg_cols])
                    plgpu.wgmma_wait(0)
                    return accs

                @pl.when(g >= 0)
                def _():
                    if swiglu:  # the gate's and the up's column tiles
                        half = w_gmem.shape[2] // 2
                        ws = (w_gmem.at[g, :, n_cols], w_gmem.at[g, :, pl.ds(half + n_idx * cta_n, cta_n)])
                    else:
                        ws = (w_gmem.at[g, :, n_cols],)
                    pipeline(mma, context)(x_gmem.at[m_rows, :], *ws, allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if num_programs is None:
        num_programs = jax.devices()[0].core_count if not interpret else 4
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((R, cols), x.dtype), grid=(num_programs,), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else False)
    return kernel(block_expert.astype(jnp.int32), x, w)
