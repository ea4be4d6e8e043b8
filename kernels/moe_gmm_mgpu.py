"""The prefill experts' grouped GEMM on Mosaic GPU (Pallas' wgmma + TMA backend), warp-specialized.

    x [R, K] (token copies in moe_gmm's expert-aligned rows), w [G, K, N], block_expert [R // tile_m] int32
        -> y [R, N]: for each row block b with g = block_expert[b] >= 0, y[b's rows] = x[b's rows] @ w[g]

The layout is `moe_gmm.align_tokens`' (vLLM's fused-MoE one) at block_m = tile_m: every row block belongs to one
expert, so every tile multiplies one expert's weights and is stored whole (no laddered store as in jax's
`ragged_dot_mgpu`). A layer of stacked weights [L, E, K, N] is passed as [L * E, K, N] (a free reshape) with the
block ids offset by layer * E. Rows of blocks with id -1 are not written (their contents are undefined).

Why (benchmarks/RESULTS.md, session 33, one H100 at Protocol A's prefill, 98,304 rows): our Triton experts reach
577-592 TFLOP/s, jax's warp-specialized dense example 745-772, cuBLAS 799-813. This kernel is that example's
structure with the grouping added: per SM a persistent loop over (row block, 2 x tile_n column tile); one memory
warpgroup streams [tile_m, tile_k] of x and [tile_k, 2 x tile_n] of w[g] by TMA through `steps` shared-memory
stages; two compute warpgroups each accumulate a [tile_m, tile_n] half with wgmma in fp32 registers, then store
it in 64 x 64 epilogue tiles through shared memory by TMA.

Not yet measured on a GPU, and not yet in the model: the gather of x's rows (TMA has no row gather on Hopper) and
gate_up's SwiGLU stay outside it. Three parts (ARCHITECTURE.md rule 6): `grouped_matmul` (the kernel;
`interpret=True` runs it in Mosaic GPU's interpreter on the CPU) and `grouped_matmul_reference` (pure JAX).
Invariants: R % tile_m == 0, N % (2 * tile_n) == 0, K % tile_k == 0; bf16 or fp16 operands.
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


@functools.partial(jax.jit, static_argnames=("tile_m", "tile_n", "tile_k", "steps", "minor", "width",
                                             "num_programs", "interpret"))
def grouped_matmul(x, w, block_expert, *, tile_m=128, tile_n=128, tile_k=64, steps=4, minor="m", width=8,
                   num_programs=None, interpret=False) -> jax.Array:
    """The kernel (module docstring). Tiles: tile_m rows (= align_tokens' block_m), 2 x tile_n columns a CTA (one
    tile_n half a compute warpgroup), tile_k deep, `steps` pipeline stages; the (row block, column tile) pairs are
    walked in bands `width` wide along the `minor` dimension ("m": consecutive CTAs take the next row blocks of one
    column tile, mostly one expert's weights). `num_programs` CTAs (default: the device's SMs)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    R, K = x.shape
    G, K2, N = w.shape
    cta_n = 2 * tile_n
    assert K == K2 and R % tile_m == 0 and N % cta_n == 0 and K % tile_k == 0, (x.shape, w.shape)
    assert block_expert.shape == (R // tile_m,), (block_expert.shape, R, tile_m)
    assert tile_m % EPILOGUE == 0 and tile_n % EPILOGUE == 0
    m_iters, n_iters, k_iters = R // tile_m, N // cta_n, K // tile_k
    bits = jnp.dtype(x.dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(tile_k * bits)
    transforms = (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(EPILOGUE * bits)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle * 8 // bits)), plgpu.SwizzleTransform(out_swizzle))
    minor_dim = 0 if minor == "m" else 1  # plgpu.planar_snake's minor dimension

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((tile_m, tile_k), lambda k: (0, k), transforms=transforms,
                                      memory_space=plgpu.SMEM),
                      plgpu.BlockSpec((tile_k, cta_n), lambda k: (k, 0), transforms=transforms,
                                      memory_space=plgpu.SMEM)],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=steps, compute_context=context)

    def body(be_gmem, x_gmem, w_gmem, y_gmem):
        ignore = lambda *_, **__: None  # noqa: E731  the allocations do not depend on the bodies

        @functools.partial(pl.run_scoped, allocs=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem.at[0]),
                           out_smem=plgpu.SMEM((2, 2, EPILOGUE, EPILOGUE), y_gmem.dtype, transforms=out_transforms),
                           collective_axes="wg")
        def scope(allocs, out_smem):
            wg = lax.axis_index("wg")
            wg_n = pl.ds(wg * tile_n, tile_n)

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def tile_loop(info):
                m_idx, n_idx = plgpu.planar_snake(info.index[0], (m_iters, n_iters), minor_dim, width)
                g = be_gmem[m_idx]
                m_rows, n_cols = pl.ds(m_idx * tile_m, tile_m), pl.ds(n_idx * cta_n, cta_n)

                def context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                    def acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...].astype(y_gmem.dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        tiles_n = tile_n // EPILOGUE
                        for i in range(tile_m // EPILOGUE):
                            for j in range(tiles_n):
                                rows, cols = slice(i * EPILOGUE, (i + 1) * EPILOGUE), slice(j * EPILOGUE,
                                                                                            (j + 1) * EPILOGUE)
                                slot = (i * tiles_n + j) % 2
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                out_smem[wg, slot] = acc[rows, cols]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(out_smem.at[wg, slot],
                                                        y_gmem.at[m_rows, n_cols].at[:, wg_n].at[rows, cols])

                def mma(idxs, x_smem, w_smem, acc_ref):
                    plgpu.wgmma(acc_ref, x_smem, w_smem.at[:, wg_n])
                    plgpu.wgmma_wait(0)
                    return acc_ref

                @pl.when(g >= 0)
                def _():
                    pipeline(mma, context)(x_gmem.at[m_rows, :], w_gmem.at[g, :, n_cols], allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if num_programs is None:
        num_programs = jax.devices()[0].core_count if not interpret else 4
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((R, N), x.dtype), grid=(num_programs,), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else False)
    return kernel(block_expert.astype(jnp.int32), x, w)
