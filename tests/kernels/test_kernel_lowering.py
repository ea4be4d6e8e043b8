"""Static checks of the Triton IR our Pallas kernels lower to for an H200 (no GPU needed): every kernel
lowers at the V2-Lite shapes (interpret mode cannot catch what only the Triton lowering rejects), and
the attention kernels address large caches with 64-bit offsets.

The attention kernels read the whole paged cache [L, P, page, 576] with a layer index: a cache over
4 GiB needs 64-bit pointer offsets, or loads from the upper pages would wrap around. jax's Pallas-Triton
lowering picks 64-bit offsets for refs over 2**32 bytes; this test pins that behaviour, which lets the
engine size the cache from the device memory instead of capping it at 2**31 elements. For 1-byte arrays
(FP8 weights) the same rule would leave i32 offsets on 2**31 to 2**32 elements; kernels/triton_offsets.py
widens them, and the FP8 tests below pin it at DeepSeek-V3's sizes.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import pytest

from deepinfer_jax.kernels.mla_decode import QK_CHUNKS, paged_mla_attention
from deepinfer_jax.kernels.mla_prefill import paged_mla_prefill_attention
from deepinfer_jax.kernels.moe_gmm import moe_experts

T, H, R, DR, PS, L = 64, 16, 512, 64, 64, 27


@pytest.fixture
def triton_modules(cuda_lowering, monkeypatch):
    """Lower for CUDA on this CPU machine (conftest.py) and return the Triton modules."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    captured = []
    lower = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        out = lower(*a, **k)
        captured.append(out.module.operation.get_asm())
        return out

    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", capture)

    def run(fn, *args):
        captured.clear()
        cuda_lowering(fn, *args)
        return list(captured)

    return run


@pytest.fixture
def triton_ir(triton_modules):
    def run(kernel, num_pages):
        s = jax.ShapeDtypeStruct
        args = (s((T, H, R), jnp.bfloat16), s((T, H, DR), jnp.bfloat16), s((L, num_pages, PS, R + DR), jnp.bfloat16),
                s((), jnp.int32), s((T,), jnp.int32), s((T,), jnp.int32), s((8, 16), jnp.int32))
        (ir,) = triton_modules(lambda *a: kernel(*a, 0.1), *args)
        return ir

    return run


def _cache_pointer_offsets(ir: str) -> set[str]:
    """The offset types of the bf16 tensor pointers (the cache and query tiles) in the module."""
    return {line.rsplit(",", 1)[1].strip().split("x")[-1].rstrip(">")
            for line in ir.splitlines() if "tt.addptr" in line and "ptr<bf16>" in line and "tensor<" in line}


@pytest.mark.parametrize("kernel", [paged_mla_attention, paged_mla_prefill_attention])
def test_cache_over_4_gib_uses_64_bit_offsets(triton_ir, kernel):
    small = 2000  # 27 x 2000 pages x 64 x 576 x 2 bytes = 3.98 GB
    big = 40000  # 79.6 GB, as on an H200
    assert _cache_pointer_offsets(triton_ir(kernel, small)) == {"i32"}  # every ref under 4 GiB
    assert "i64" in _cache_pointer_offsets(triton_ir(kernel, big))  # the cache's loads switch to 64 bits


@pytest.mark.parametrize("pages_per_step", [1, 2, 4])
def test_decode_attention_with_several_pages_per_step_lowers_for_sm90(triton_modules, pages_per_step):
    s = jax.ShapeDtypeStruct
    args = (s((16, H, R), jnp.bfloat16), s((16, H, DR), jnp.bfloat16), s((L, 40000, PS, R + DR), jnp.bfloat16),
            s((), jnp.int32), s((16,), jnp.int32), s((16,), jnp.int32), s((16, 64), jnp.int32))
    (ir,) = triton_modules(lambda *a: paged_mla_attention(*a, 0.1, pages_per_step=pages_per_step), *args)
    # Per page: latent and rope scores, values; one loop step. One block a step cuts the latent in QK_CHUNKS.
    dots = 2 * QK_CHUNKS + 1 if pages_per_step == 1 else 3 * pages_per_step
    assert ir.count("tt.dot") == dots


@pytest.mark.parametrize("block_keys", [16, 32])
def test_decode_attention_with_key_blocks_under_a_page_lowers_for_sm90(triton_modules, block_keys):
    s = jax.ShapeDtypeStruct
    args = (s((16, H, R), jnp.bfloat16), s((16, H, DR), jnp.bfloat16), s((L, 40000, PS, R + DR), jnp.bfloat16),
            s((), jnp.int32), s((16,), jnp.int32), s((16,), jnp.int32), s((16, 64), jnp.int32))
    (ir,) = triton_modules(lambda *a: paged_mla_attention(*a, 0.1, block_keys=block_keys), *args)
    assert ir.count("tt.dot") == 2 * QK_CHUNKS + 1
    # The latent keys are loaded block_keys rows at a time, in QK_CHUNKS column chunks.
    assert f"tensor<{block_keys}x{R // QK_CHUNKS}xbf16>" in ir


@pytest.mark.parametrize("T, chunk", [(128, 512), (256, 256)])
def test_route_launch_slices_x_to_fit_shared_memory(triton_modules, T, chunk):
    """The route launch's router chunks at V2-Lite's shape: [T, D / C] slices of x, 4 chunks up to 128 tokens and 8
    at 256 (4 would hold 320 KiB of x and gate slices in shared memory: an H200 refused to compile it)."""
    from deepinfer_jax.kernels.residual_route import residual_route

    s = jax.ShapeDtypeStruct
    args = (s((8, T, 2048), jnp.float32), s((T, 2048), jnp.bfloat16), s((26, 2048), jnp.bfloat16),
            s((26, 2048, 64), jnp.bfloat16), s((), jnp.int32))
    (ir,) = triton_modules(lambda *a: residual_route(*a, eps=1e-6, k=6, num_shared=2, block_m=16), *args)
    assert f"tensor<{T}x{chunk}xbf16>" in ir and f"tensor<{chunk}x64xbf16>" in ir


@pytest.mark.parametrize("shared", [False, True])
def test_moe_kernels_lower_for_sm90(triton_modules, shared):
    """Both MoE kernels lower at the V2-Lite layer shape (stacked weights read in place); with the
    shared experts each kernel gets a second weight branch."""
    s = jax.ShapeDtypeStruct
    Lm, E, D, I, k, S = 26, 64, 2048, 1408, 6, 2
    args = [s((32, D), jnp.bfloat16), s((Lm, E, D, 2, I), jnp.bfloat16), s((Lm, E, I, D), jnp.bfloat16),
            s((32, k), jnp.float32), s((32, k), jnp.int32), s((), jnp.int32)]
    if shared:
        args += [s((Lm, D, 2, S * I), jnp.bfloat16), s((Lm, S * I, D), jnp.bfloat16)]
        fn = lambda x, a, b, w, i, l, sa, sb: moe_experts(x, a, b, w, i, l, shared_gate_up=sa, shared_down=sb)  # noqa: E731
    else:
        fn = moe_experts
    irs = triton_modules(fn, *args)
    assert len(irs) == 2
    for ir in irs:
        assert ir.count("scf.if") == (2 if shared else 1)


@pytest.mark.parametrize("T", [1, 32, 256])
@pytest.mark.parametrize("bias", [True, False])
def test_route_align_lowers_for_sm90(triton_modules, T, bias):
    from deepinfer_jax.kernels.moe_route import route_align

    s = jax.ShapeDtypeStruct
    if bias:
        irs = triton_modules(lambda lg, b: route_align(lg, b, k=6, num_shared=2, block_m=16),
                             s((T, 64), jnp.float32), s((64,), jnp.float32))
    else:  # V2-Lite's greedy softmax routing: no bias operand
        irs = triton_modules(lambda lg: route_align(lg, None, k=6, num_shared=2, block_m=16), s((T, 64), jnp.float32))
    assert len(irs) == 1 and "tt.scan" in irs[0]  # the cumsums lower to Triton scans


def test_fused_decode_lowers_for_sm90(triton_modules):
    """Routing kernel + both expert kernels, the gate_up kernel gathering its rows from x (V2-Lite shape)."""
    from deepinfer_jax.kernels.moe_route import moe_fused_decode

    s = jax.ShapeDtypeStruct
    Lm, E, D, I, S = 26, 64, 2048, 1408, 2
    args = (s((32, D), jnp.bfloat16), s((32, E), jnp.float32), s((E,), jnp.float32), s((Lm, E, D, 2, I), jnp.bfloat16),
            s((Lm, E, I, D), jnp.bfloat16), s((), jnp.int32), s((Lm, D, 2, S * I), jnp.bfloat16),
            s((Lm, S * I, D), jnp.bfloat16))
    irs = triton_modules(lambda x, lg, b, a, d, l, sa, sd: moe_fused_decode(x, lg, b, a, d, l, sa, sd, k=6), *args)
    assert len(irs) == 3


def test_single_launch_moe_lowers_for_sm90(triton_modules):
    """Both expert kernels in one launch (moe_gmm `single_launch`): the down tiles' wait on their row block's
    gate_up tiles lowers to a loop of acquire atomics, the gate_up tiles' release to a barrier and an atomic add."""
    from deepinfer_jax.kernels import moe_route

    s = jax.ShapeDtypeStruct
    Lm, E, D, I, S = 26, 64, 2048, 1408, 2
    args = (s((32, D), jnp.bfloat16), s((32, E), jnp.float32), s((Lm, E, D, 2, I), jnp.bfloat16),
            s((Lm, E, I, D), jnp.bfloat16), s((), jnp.int32), s((Lm, D, 2, S * I), jnp.bfloat16),
            s((Lm, S * I, D), jnp.bfloat16))
    irs = triton_modules(lambda x, lg, a, d, l, sa, sd: moe_route.moe_fused_decode(x, lg, None, a, d, l, sa, sd, k=6,
                                                                                    single_launch=True),
                         *args)
    assert len(irs) == 2  # the routing kernel and the experts' one launch
    experts = irs[1]
    assert experts.count("tt.atomic_rmw") == 2 * 3  # per weight branch (routed, shared): a release, two acquires
    assert "scf.while" in experts and "gpu.barrier" in experts


@pytest.mark.parametrize("qk_chunks", [1, 2])
def test_decode_attention_with_the_latent_in_chunks_lowers_for_sm90(triton_modules, qk_chunks):
    """qk_chunks at V2-Lite's latent (the default, QK_CHUNKS, above): per key block qk_chunks + 1 score dots
    and qk_chunks value dots."""
    s = jax.ShapeDtypeStruct
    args = (s((32, H, R), jnp.bfloat16), s((32, H, DR), jnp.bfloat16), s((L, 600, PS, R + DR), jnp.bfloat16),
            s((), jnp.int32), s((32,), jnp.int32), s((32,), jnp.int32), s((32, 16), jnp.int32))
    (ir,) = triton_modules(lambda *a: paged_mla_attention(*a, 0.1, qk_chunks=qk_chunks), *args)
    assert ir.count("tt.dot") == 2 * qk_chunks + 1


def test_split_prefill_attention_lowers_for_sm90(triton_modules):
    """The expanded chunk kernel at V2-Lite's head dims (128 + 64 keys, 128 values, 64-token query
    blocks) and the context-only absorbed kernel returning its softmax statistics, for an 8,192-token
    prefill bucket."""
    from deepinfer_jax.kernels.mla_chunk import chunk_attention
    from deepinfer_jax.kernels.mla_prefill import num_query_blocks_bound, query_blocks, run_starts

    s = jax.ShapeDtypeStruct
    Tp, S = 8192, 32

    def split(qn, qp, kv, kp, ql, cache, sid, pos, pt):
        rs = run_starts(sid, pos)
        blocks = query_blocks(sid, pos, 64, num_query_blocks_bound(Tp, S, 64))
        chunk = chunk_attention(qn, qp, kv, kp, rs, blocks, 0.1, block_q=64)
        ctx = paged_mla_prefill_attention(ql, qp, cache, 0, sid, pos, pt, 0.1, visible_to=pos[rs] - 1,
                                          return_lse=True)
        return chunk, ctx

    args = (s((Tp, H, 128), jnp.bfloat16), s((Tp, H, DR), jnp.bfloat16), s((Tp, H, 256), jnp.bfloat16),
            s((Tp, DR), jnp.bfloat16), s((Tp, H, R), jnp.bfloat16), s((L, 300, PS, R + DR), jnp.bfloat16),
            s((Tp,), jnp.int32), s((Tp,), jnp.int32), s((S, 16), jnp.int32))
    irs = triton_modules(split, *args)
    assert len(irs) == 2
    assert all("tt.dot" in ir for ir in irs)


def test_decode_attention_output_lowers_for_sm90(triton_modules):
    """The decode attention's splits, then the output kernel merging them and applying W_UV read in
    place from the stacked kv_b_proj (V2-Lite: 16 heads, 512-wide latent, 128 + 128 per head)."""
    from deepinfer_jax.kernels.mla_decode import paged_mla_attention_splits
    from deepinfer_jax.kernels.mla_output import merge_value_projection

    s = jax.ShapeDtypeStruct

    def attend(ql, qp, cache, sid, pos, pt, kv_b):
        o, m, l = paged_mla_attention_splits(ql, qp, cache, 3, sid, pos, pt, 0.1)
        return merge_value_projection(o, m, l, kv_b, 3, dn=128, dtype=jnp.bfloat16)

    args = (s((32, H, R), jnp.bfloat16), s((32, H, DR), jnp.bfloat16), s((L, 40000, PS, R + DR), jnp.bfloat16),
            s((32,), jnp.int32), s((32,), jnp.int32), s((32, 64), jnp.int32), s((L, R, H, 256), jnp.bfloat16))
    irs = triton_modules(attend, *args)
    assert len(irs) == 2
    assert irs[1].count("tt.dot") == 1  # the [16, 512] x [512, 64] W_UV tile; the merge is elementwise


def test_decode_absorb_lowers_for_sm90(triton_modules):
    """The query's absorption and RoPE at V2-Lite's shape: q read from the whole q projection [32, 16,
    192], W_UK from the stacked kv_b_proj [L, 512, 16, 256], one [32, 128] x [128, 64] dot a program, the
    rope part's even and odd lanes in strided loads and stores."""
    from deepinfer_jax.kernels.mla_absorb import absorb_query

    s = jax.ShapeDtypeStruct
    irs = triton_modules(lambda q, kv_b, c, sn: absorb_query(q, kv_b, 3, c, sn, dn=128),
                         s((32, H, 192), jnp.bfloat16), s((L, R, H, 256), jnp.bfloat16),
                         s((32, DR // 2), jnp.float32), s((32, DR // 2), jnp.float32))
    assert len(irs) == 1 and irs[0].count("tt.dot") == 1 and irs[0].count("tt.store") == 3


def test_decode_absorb_and_latent_write_lower_for_sm90(triton_modules):
    """The absorb kernel's launch that also writes the step's latents (V2-Lite, 32 tokens): 32 latent
    programs plus the 16 x 8 absorb programs; the latent row's RMS as a reduction, its c_kv store and the
    rope part's even and odd lanes stored into an H200-sized cache with 64-bit offsets; the cache aliased
    to the kernel's third output, so it is written in place."""
    from deepinfer_jax.kernels.mla_absorb import absorb_query_write_latents

    s = jax.ShapeDtypeStruct
    fn = lambda q, kv_b, c, sn, ckv, nw, cache, slots: absorb_query_write_latents(  # noqa: E731
        q, kv_b, 3, c, sn, ckv, nw, cache, 4, slots, dn=128, eps=1e-6)
    args = (s((32, H, 192), jnp.bfloat16), s((L, R, H, 256), jnp.bfloat16), s((32, DR // 2), jnp.float32),
            s((32, DR // 2), jnp.float32), s((32, R + DR), jnp.bfloat16), s((L, R), jnp.bfloat16),
            s((L, 40000, PS, R + DR), jnp.bfloat16), s((32,), jnp.int32))
    (ir,) = triton_modules(fn, *args)
    assert ir.count("tt.dot") == 1 and ir.count("tt.store") == 6 and "tt.reduce" in ir
    assert "tensor<512xi64>" in ir  # the latent row's store offsets into the 79.6 GB cache
    hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "grid_x = 160" in hlo and "output_operand_alias<output_tuple_indices = [2], operand_index = 9" in hlo


def test_absorb_latents_from_the_merged_projection_lower_for_sm90(triton_modules):
    """The same launch reading q and the kv_a rows in place out of the merged q / kv_a projection [32, 16 x 192 +
    576] (RunnerConfig.decode_merged_qkv): one operand passed twice, the same 160 programs, dot and stores; the
    cache still written in place."""
    from deepinfer_jax.kernels.mla_absorb import absorb_query_write_latents

    s = jax.ShapeDtypeStruct
    fn = lambda qkv, kv_b, c, sn, nw, cache, slots: absorb_query_write_latents(  # noqa: E731
        qkv, kv_b, 3, c, sn, None, nw, cache, 4, slots, dn=128, eps=1e-6)
    args = (s((32, H * 192 + R + DR), jnp.bfloat16), s((L, R, H, 256), jnp.bfloat16), s((32, DR // 2), jnp.float32),
            s((32, DR // 2), jnp.float32), s((L, R), jnp.bfloat16), s((L, 40000, PS, R + DR), jnp.bfloat16),
            s((32,), jnp.int32))
    (ir,) = triton_modules(fn, *args)
    assert ir.count("tt.dot") == 1 and ir.count("tt.store") == 6 and "tt.reduce" in ir
    hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "grid_x = 160" in hlo and "output_operand_alias<output_tuple_indices = [2], operand_index = 9" in hlo


def test_residual_route_lowers_for_sm90(triton_modules):
    """o_proj's partials to the routing in one launch at V2-Lite's shape (8 partials, D 2048, 64 experts + 2
    shared, batch 32): two phase releases after a barrier, two acquire loops, the router's one dot and the
    routing's scans."""
    from deepinfer_jax.kernels.residual_route import residual_route

    s = jax.ShapeDtypeStruct
    args = (s((8, 32, 2048), jnp.float32), s((32, 2048), jnp.bfloat16), s((26, 2048), jnp.bfloat16),
            s((26, 2048, 64), jnp.bfloat16))
    (ir,) = triton_modules(lambda p, h, nw, g: residual_route(p, h, nw, g, 5, eps=1e-6, k=6, num_shared=2,
                                                              block_m=16), *args)
    assert ir.count("tt.atomic_rmw") == 2 + 2 * 2 and ir.count("scf.while") == 2 and "gpu.barrier" in ir
    assert ir.count("tt.dot") == 1 and "tt.scan" in ir


def test_route_and_experts_launch_lowers_for_sm90(triton_modules):
    """The route launch and the experts' single launch as one grid (kernels/route_experts.py) at V2-Lite's shape
    (batch 32, 64 experts + 2 shared): one kernel; the router's dot, the gate_up tiles' two and the down tiles' one
    for the shared and the routed branch; the routing's scans; acquire loops for x, the router chunks, the routing
    (routed gate_up and down tiles) and the row blocks (shared and routed down tiles)."""
    from deepinfer_jax.kernels.route_experts import route_experts

    s = jax.ShapeDtypeStruct
    Lm, E, D, I, S = 26, 64, 2048, 1408, 2
    args = (s((8, 32, D), jnp.float32), s((32, D), jnp.bfloat16), s((Lm, D), jnp.bfloat16), s((Lm, D, E), jnp.bfloat16),
            s((Lm, E, D, 2, I), jnp.bfloat16), s((Lm, E, I, D), jnp.bfloat16), s((Lm, D, 2, S * I), jnp.bfloat16),
            s((Lm, S * I, D), jnp.bfloat16))
    (ir,) = triton_modules(lambda p, h, nw, g, a, d, sa, sd: route_experts(p, h, nw, g, 5, a, d, sa, sd, eps=1e-6, k=6),
                           *args)
    assert ir.count("tt.dot") == 1 + 2 * 3 and "tt.scan" in ir and "gpu.barrier" in ir
    # waits: router chunks on x, routing on the chunks, shared gate_up on x, shared down on its block, routed
    # gate_up on the routing, routed down on the routing and on its block
    assert ir.count("scf.while") == 7



def _fp8_pointer_offsets(ir: str) -> set[str]:
    """The offset types of the e4m3 tensor pointers (the FP8 weight tiles) in the module."""
    return {line.rsplit(",", 1)[1].strip().split("x")[-1].rstrip(">")
            for line in ir.splitlines() if "tt.addptr" in line and "ptr<f8E4M3FN>" in line and "tensor<" in line}


def test_fp8_experts_of_one_v3_layer_use_64_bit_offsets(triton_modules):
    """DeepSeek-V3's routed experts of one layer in FP8 as the checkpoint stores them ("nk"): gate_up [1, 256, 2,
    2048, 7168] is 7.5 GB and down [1, 256, 7168, 2048] 3.8 GB, 3.8e9 elements: over 2**31, so i32 offsets would
    wrap (kernels/triton_offsets.py); both kernels read their weight with 64-bit offsets (the activations' small
    e4m3 tiles keep 32-bit ones)."""
    from deepinfer_jax.kernels.moe_gmm_quant import WeightFormat, moe_experts_quant

    s = jax.ShapeDtypeStruct
    E, D, I, k, f8 = 256, 7168, 2048, 8, jnp.float8_e4m3fn
    fmt = WeightFormat("fp8", group=128, block_n=128, act="fp8", layout="nk")
    args = (s((32, D), jnp.bfloat16), s((1, E, 2, I, D), f8), s((1, E, 2, I // 128, D // 128), jnp.float32),
            s((1, E, D, I), f8), s((1, E, D // 128, I // 128), jnp.float32), s((32, k), jnp.float32),
            s((32, k), jnp.int32), s((), jnp.int32))
    irs = triton_modules(lambda *a: moe_experts_quant(*a, fmt_gu=fmt, fmt_down=fmt), *args)
    assert len(irs) == 2
    assert [_fp8_pointer_offsets(ir) for ir in irs] == [{"i32", "i64"}, {"i32", "i64"}]


@pytest.mark.parametrize("layers, offsets", [(1, {"i32"}), (61, {"i32", "i64"})])
def test_fp8_gemm_on_stacked_v3_weights_uses_64_bit_offsets(triton_modules, layers, offsets):
    """V3's q_b_proj [N 24576, K 1536] in FP8: one layer (38 MB) keeps i32 offsets; stacked over 61 layers it
    is 2.3e9 elements in 2.3 GB, under 2**32 bytes but over 2**31 elements, and takes i64 (x's e4m3 tiles keep
    i32)."""
    from deepinfer_jax.kernels.fp8_gemm import fp8_matmul

    s = jax.ShapeDtypeStruct
    N, K = 24576, 1536
    args = (s((32, K), jnp.bfloat16), s((layers, N, K), jnp.float8_e4m3fn), s((layers, N // 128, K // 128),
                                                                              jnp.float32), s((), jnp.int32))
    (ir,) = triton_modules(lambda x, q, sc, l: fp8_matmul(x, q, sc, l, layout="nk"), *args)
    assert _fp8_pointer_offsets(ir) == offsets


@pytest.mark.parametrize("kernel", [paged_mla_attention, paged_mla_prefill_attention])
def test_attention_on_an_fp8_cache_lowers_for_sm90(triton_modules, kernel):
    """An e4m3 cache at H200 size (79.6 GB in bf16, half in e4m3: 64-bit offsets either way): the pages load as
    e4m3 and widen to bf16 before the score and value dots."""
    s = jax.ShapeDtypeStruct
    args = (s((T, H, R), jnp.bfloat16), s((T, H, DR), jnp.bfloat16),
            s((L, 80000, PS, R + DR), jnp.float8_e4m3fn), s((), jnp.int32), s((T,), jnp.int32), s((T,), jnp.int32),
            s((8, 16), jnp.int32))
    (ir,) = triton_modules(lambda *a: kernel(*a, 0.1), *args)
    assert "i64" in _fp8_pointer_offsets(ir) and "tt.fp_to_fp" in ir
    assert not [ln for ln in ir.splitlines() if "tt.dot" in ln and "f8E4M3FN" in ln]


def test_latent_write_into_an_fp8_cache_lowers_for_sm90(triton_modules):
    """The absorb launch's latent write into an e4m3 cache: the stores narrow to e4m3 (saturated first)."""
    from deepinfer_jax.kernels.mla_absorb import absorb_query_write_latents

    s = jax.ShapeDtypeStruct
    fn = lambda q, kv_b, c, sn, ckv, nw, cache, slots: absorb_query_write_latents(  # noqa: E731
        q, kv_b, 3, c, sn, ckv, nw, cache, 4, slots, dn=128, eps=1e-6)
    args = (s((32, H, 192), jnp.bfloat16), s((L, R, H, 256), jnp.bfloat16), s((32, DR // 2), jnp.float32),
            s((32, DR // 2), jnp.float32), s((32, R + DR), jnp.bfloat16), s((L, R), jnp.bfloat16),
            s((L, 40000, PS, R + DR), jnp.float8_e4m3fn), s((32,), jnp.int32))
    (ir,) = triton_modules(fn, *args)
    assert ir.count("tt.store") == 6 and "tt.fp_to_fp" in ir


@pytest.mark.parametrize("heads, kv_heads, window", [(32, 8, None), (28, 4, None), (32, 8, 4096)])
def test_dense_prefill_attention_lowers_for_sm90(triton_modules, heads, kv_heads, window):
    """The dense family's query-block prefill attention at Llama-3.1-8B's heads (G = 4), Qwen2.5-7B's (G = 7: the
    tile's heads padded to 8 and moved back at the last KV head) and Mistral's window, a 16,384-token step: q read
    in place as [block_q, Gp, hd] tiles and the output stored in place with a mask, one QK^T and one PV dot."""
    from deepinfer_jax.kernels.gqa_prefill import ragged_gqa_attention

    s, Tp = jax.ShapeDtypeStruct, 16384
    args = (s((Tp, heads, 128), jnp.bfloat16), s((32, 300, PS, 2, kv_heads, 128), jnp.bfloat16), s((), jnp.int32),
            s((Tp,), jnp.int32), s((Tp,), jnp.int32), s((32, 16), jnp.int32))
    (ir,) = triton_modules(lambda *a: ragged_gqa_attention(*a, 0.088, window), *args)
    assert ir.count("tt.dot") == 2
    assert "tt.reshape" in ir  # the [block_q, Gp, hd] tile as [block_q * Gp, hd] rows and back


def test_expanded_context_window_lowers_for_sm90(triton_modules):
    """The expanded context kernel at V2-Lite's head dims over an 8,192-key window, its softmax state aliased in
    and out, in an 8,192-token prefill bucket."""
    from deepinfer_jax.kernels.mla_context import window_attention
    from deepinfer_jax.kernels.mla_prefill import num_query_blocks_bound, query_blocks

    s = jax.ShapeDtypeStruct
    Tp, S, W = 8192, 32, 8192

    def window(qn, qp, kv, kp, sid, pos, lo, hi, acc, m, l):
        blocks = query_blocks(sid, pos, 64, num_query_blocks_bound(Tp, S, 64))
        return window_attention(qn, qp, kv, kp, blocks, lo, hi, 0.1, acc, m, l, block_q=64)

    nb = num_query_blocks_bound(Tp, S, 64)
    args = (s((Tp, H, 128), jnp.bfloat16), s((Tp, H, DR), jnp.bfloat16), s((W, H, 256), jnp.bfloat16),
            s((W, DR), jnp.bfloat16), s((Tp,), jnp.int32), s((Tp,), jnp.int32), s((nb,), jnp.int32),
            s((nb,), jnp.int32), s((Tp, H, 128), jnp.float32), s((Tp, H), jnp.float32), s((Tp, H), jnp.float32))
    (ir,) = triton_modules(window, *args)
    assert ir.count("tt.dot") == 3  # q_nope . k_nope, q_pe . k_pe, p . v
