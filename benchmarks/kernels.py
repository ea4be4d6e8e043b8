"""Per-kernel checks and timings on the GPU: each kernel against its reference, then achieved bytes/s
and FLOP/s against the ceilings measured on an H200 (4.3 TB/s copy, 587 TFLOP/s bf16 matmul).

    python benchmarks/kernels.py [--quick] [--only moe|moe_prefill|mla|mla_output|mla_prefill|decode_sweep|gqa_prefill]
    python benchmarks/kernels.py --only moe_prefill --moe-tokens 2731,16384   # Triton against Mosaic GPU experts

MoE (V2-Lite expert shape: 64 experts, 2048 -> 1408, top-6): the Pallas block-aligned grouped GEMM
(several tile configs), `jax.lax.ragged_dot`, and Mosaic GPU `ragged_dot_mgpu` when present, at
decode and prefill token counts. MLA decode (16 heads, 576-wide latent, page 64): the Pallas kernel
at several context splits and the XLA reference, batch 1 to 256, context 512 to 32K. MLA prefill
(same shape): the block-query prefill kernel at several tile configs against the decode kernel and
the XLA reference on the same ragged steps (16 fresh prompts of 512, one 512-token chunk after 1,536
cached tokens, and chunks mixed with decode tokens and padding). The decode attention's output kernel
(splits merged, W_UV applied) against the XLA merge and einsum. The dense family's GQA prefill attention
(query blocks) at several tile configs against its decode kernel and the XLA reference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HBM = 4.3e12
MXU = 587e12


def bench(fn, *args, iters=20):
    import jax

    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), out


def device_us(fn, *args, iters=10) -> dict[str, float]:
    """GPU time per call of each kernel `fn` launches (us, by kernel name), from a profiler trace of
    `iters` calls: the kernels' own durations, without the host's dispatch that `bench` includes."""
    import tempfile

    import jax

    from benchmarks.trace_tools import gpu_kernels

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(iters):
                jax.block_until_ready(fn(*args))
        kern = gpu_kernels(d) or []
    out: dict[str, float] = {}
    for e in kern:
        if "memcpy" not in e["name"].lower():
            out[e["name"]] = out.get(e["name"], 0.0) + e.get("dur", 0.0) / iters
    return out


def max_err(out, ref) -> str:
    """The max abs difference of a kernel's output from the reference (fp32 numpy), or "-" without one."""
    return "-" if ref is None else f"{np.abs(np.asarray(out, np.float32) - ref).max():.3g}"


def moe_tables(quick: bool, tokens: list[int] | None = None):
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.moe_gmm import moe_experts, moe_experts_reference

    E, D, I, k = 64, 2048, 1408, 6
    key = jax.random.key(0)
    wgu = jax.random.uniform(key, (E, D, 2, I), jnp.bfloat16, -0.05, 0.05)
    wd = jax.random.uniform(jax.random.fold_in(key, 1), (E, I, D), jnp.bfloat16, -0.05, 0.05)
    wbytes = (wgu.size + wd.size) * 2
    print("\n## MoE experts (V2-Lite shape, bf16): time, weight bytes/s, FLOP/s")
    print("| tokens | impl | config | us | TB/s (weights touched) | TFLOP/s | max err vs ref |")
    print("|---|---|---|---|---|---|---|")
    for T in tokens or ([32, 2048] if quick else [1, 8, 32, 64, 128, 256, 2048, 8192, 16384]):
        x = jax.random.normal(jax.random.fold_in(key, 2), (T, D), jnp.bfloat16)
        logits = jax.random.normal(jax.random.fold_in(key, 3), (T, E), jnp.float32)
        w, idx = jax.lax.top_k(jax.nn.softmax(logits), k)
        idx = idx.astype(jnp.int32)
        touched = len(np.unique(np.asarray(idx)))
        flops = 2 * T * k * D * I * 3
        moved = wbytes * touched / E
        ref = None
        if T <= 64:  # the reference gathers a weight copy per token; beyond that compare against ragged_dot
            ref = np.asarray(jax.jit(moe_experts_reference)(x, wgu, wd, w, idx).astype(jnp.float32))
        # (block_m, block_n, block_k, warps, stages, cols_first, gather_in_kernel)
        configs = [(16, 128, 64, 4, 3, False, False), (16, 128, 64, 4, 3, True, False),
                   (16, 128, 64, 4, 3, False, True), (16, 256, 64, 4, 3, False, False),
                   (16, 256, 64, 4, 3, True, False), (16, 128, 64, 4, 5, False, False)]
        if 128 <= T < 1024:  # 128-512 sequences a decode step (issue 54): ~12-48 rows an expert, so a 16-row block
            # reads an expert's weights 1-3 times; 32 / 64-row blocks read them once, padding the rows instead
            configs += [(32, 256, 64, 4, 3, False, False), (32, 128, 64, 4, 3, False, False),
                        (64, 128, 64, 4, 3, False, False), (64, 256, 64, 8, 3, False, False),
                        (64, 128, 64, 8, 4, True, False)]
        if T >= 1024:
            configs = [(128, 128, 64, 8, 4, False, False), (128, 128, 64, 8, 4, True, False),
                       (128, 128, 64, 8, 4, True, True), (128, 128, 64, 8, 4, False, True),
                       (128, 256, 64, 8, 3, True, False), (128, 128, 64, 8, 3, True, False),
                       (64, 128, 64, 4, 3, True, False), (128, 128, 32, 4, 4, True, False)]
        if os.environ.get("MOE_QUICK"):
            configs = configs[:4]
        last = None
        for bm, bn, bk, nw, ns, cf, gk in configs:
            fn = jax.jit(lambda x, a, b, w, i, bm=bm, bn=bn, bk=bk, nw=nw, ns=ns, cf=cf, gk=gk: moe_experts(
                x, a, b, w, i, block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, cols_first=cf,
                gather_in_kernel=gk))
            try:
                t, out = bench(fn, x, wgu, wd, w, idx)
                last = np.asarray(out.astype(jnp.float32))
                err = max_err(out, ref)
                order = ("cols first" if cf else "rows first") + (", gather in kernel" if gk else "")
                print(f"| {T} | pallas | bm{bm} bn{bn} bk{bk} w{nw} s{ns}, {order} | {t*1e6:.0f} | "
                      f"{moved/t/1e12:.2f} | {flops/t/1e12:.1f} | {err} |", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"| {T} | pallas | bm{bm} bn{bn} bk{bk} | failed: {type(e).__name__}: {str(e)[:200]} |", flush=True)

        def ragged(x, wgu, wd, w, idx):
            from deepinfer_jax.models.moe import experts_ragged

            return experts_ragged({"gate_up": wgu, "down": wd}, x, w, idx)

        t, out = bench(jax.jit(ragged), x, wgu, wd, w, idx)
        err = max_err(out, ref)
        ragged_out = np.asarray(out.astype(jnp.float32))
        if ref is None and last is not None:
            err = f"(pallas vs ragged) {np.abs(last - ragged_out).max():.3g}"
        print(f"| {T} | lax.ragged_dot | - | {t*1e6:.0f} | {moved/t/1e12:.2f} | {flops/t/1e12:.1f} | {err} |", flush=True)


def moe_prefill_sweep(T: int = 16384, engine_only: bool = False):
    """The two expert kernels at a prefill size, each timed alone (GPU time from a trace) over tile configs:
    Protocol A's prefill routes 16,384 tokens x top-6 through them (two launches; the single launch is for
    decode sizes). Checked against `lax.ragged_dot` once. The last rows are what the engine runs at this size:
    its Triton defaults, and the Mosaic GPU kernels (RunnerConfig.moe_prefill_mosaic) where `mosaic_applies`,
    each with the total GPU time of the step's experts (kernels, XLA's gather of the rows and combine).
    `engine_only`: those rows alone."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.moe_gmm import (align_tokens, down_tile_config, gather_in_kernel_for, mosaic_applies,
                                               moe_experts_aligned, tile_config)

    E, D, I, k = 64, 2048, 1408, 6
    key = jax.random.key(0)
    wgu = jax.random.uniform(key, (1, E, D, 2, I), jnp.bfloat16, -0.05, 0.05)
    wd = jax.random.uniform(jax.random.fold_in(key, 1), (1, E, I, D), jnp.bfloat16, -0.05, 0.05)
    x = jax.random.normal(jax.random.fold_in(key, 2), (T, D), jnp.bfloat16)
    logits = jax.random.normal(jax.random.fold_in(key, 3), (T, E), jnp.float32)
    w, idx = jax.lax.top_k(jax.nn.softmax(logits), k)
    idx = idx.astype(jnp.int32)
    layer = jnp.zeros((1,), jnp.int32)
    flops_half = 2 * T * k * D * I * 3 / 3  # one [D, I] matrix's worth: gate_up is 2 of these, down 1
    auto = tile_config(T * k)
    print(f"\n## MoE expert kernels at {T} tokens x top-{k} (each kernel's GPU time; default {auto})")
    print("| block_m | gate_up bn bk w s | us | TFLOP/s | down bn bk w s | us | TFLOP/s | XLA kernels us | all us "
          "| max err vs ragged |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def ragged(x, wgu, wd, w, idx):
        from deepinfer_jax.models.moe import experts_ragged

        return experts_ragged({"gate_up": wgu[0], "down": wd[0]}, x, w, idx)

    ref = np.asarray(jax.jit(ragged)(x, wgu, wd, w, idx).astype(jnp.float32))
    # (gate_up bn bk warps stages, down bn bk warps stages, gather_in_kernel, mosaic) by block_m
    pairs = {128: [((128, 64, 8, 4), (128, 64, 8, 4), False, False), ((128, 64, 8, 3), (256, 64, 8, 3), False, False),
                   ((128, 64, 8, 4), (256, 64, 8, 3), True, False), ((128, 64, 8, 3), (256, 64, 8, 3), True, False),
                   ((128, 64, 8, 4), (256, 64, 8, 4), False, False), ((128, 64, 8, 4), (256, 128, 8, 2), False, False)],
             256: [((64, 64, 8, 3), (128, 64, 8, 3), False, False)]}
    engine = [(auto[1:], down_tile_config(T * k), gather_in_kernel_for(T * k), False)]
    if mosaic_applies(T * k, D, I, auto[0], x.dtype, False):
        engine.append((None, None, False, True))
    pairs = {auto[0]: engine} if engine_only else {**pairs, auto[0]: pairs.get(auto[0], []) + engine}
    for bm, configs in pairs.items():
        rc, be, ro = jax.jit(lambda i, bm=bm: align_tokens(i, E, bm))(idx)
        for gu, dn, gk, mosaic in configs:
            fn = jax.jit(lambda x, a, b, w, rc, be, ro, gu=gu or (None,) * 4, dn=dn, bm=bm, gk=gk, mosaic=mosaic:
                         moe_experts_aligned(x, a, b, w, rc, be, ro, layer, block_m=bm, block_n=gu[0], block_k=gu[1],
                                             num_warps=gu[2], num_stages=gu[3], cols_first=True, down_tiles=dn,
                                             gather_in_kernel=gk, mosaic=mosaic))
            label = ("Mosaic GPU" if mosaic else " ".join(map(str, gu))) + (" gather" if gk else "")
            try:
                err = np.abs(np.asarray(fn(x, wgu, wd, w, rc, be, ro).astype(jnp.float32)) - ref).max()
                us = device_us(fn, x, wgu, wd, w, rc, be, ro)
                if mosaic:  # both kernels are named "body_mosaic_gpu_kernel": one figure for the two
                    t1 = sum(v for n, v in us.items() if "mosaic" in n)
                    tx = sum(v for n, v in us.items() if "mosaic" not in n)
                    print(f"| {bm} | {label}, gate_up + down | {t1:.0f} | {3 * flops_half / t1 / 1e6:.0f} | - | - "
                          f"| - | {tx:.0f} | {t1 + tx:.0f} | {err:.3g} |", flush=True)
                    continue
                t1 = sum(v for n, v in us.items() if "gate_up" in n)
                t2 = sum(v for n, v in us.items() if "down" in n)
                tx = sum(v for n, v in us.items() if "gate_up" not in n and "down" not in n)
                print(f"| {bm} | {label} | {t1:.0f} | {2 * flops_half / max(t1, 1e-9) / 1e6:.0f} | "
                      f"{' '.join(map(str, dn))} | {t2:.0f} | {flops_half / max(t2, 1e-9) / 1e6:.0f} "
                      f"| {tx:.0f} | {t1 + t2 + tx:.0f} | {err:.3g} |", flush=True)
                if t1 == 0 or t2 == 0:
                    print("  kernels:", {n[:60]: round(v, 1) for n, v in us.items()}, flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"| {bm} | {label} | failed | | {dn} | {type(e).__name__}: {str(e)[:200]} |", flush=True)


def decode_attention_inputs(key, B: int, ctx: int, dtype, positions=None):
    """Random decode-attention inputs at the V2-Lite shape (16 heads, 576-wide latent, page 64): q_lat,
    q_pe, a one-layer cache of B sequences on shuffled pages, seq_ids, positions (default: every
    sequence at ctx - 1) and the page table."""
    import jax
    import jax.numpy as jnp

    H, R, dr, ps = 16, 512, 64, 64
    pages_per_seq = -(-ctx // ps)
    kv = jax.random.normal(key, (1, B * pages_per_seq + 1, ps, R + dr), dtype)
    pt = (1 + np.random.default_rng(0).permutation(B * pages_per_seq)).reshape(B, pages_per_seq).astype(np.int32)
    ql = jax.random.normal(jax.random.fold_in(key, 1), (B, H, R), dtype)
    qp = jax.random.normal(jax.random.fold_in(key, 2), (B, H, dr), dtype)
    pos = jnp.full((B,), ctx - 1, jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32)
    return ql, qp, kv, jnp.arange(B, dtype=jnp.int32), pos, jnp.asarray(pt)


def mla_tables(quick: bool):
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.mla_decode import auto_splits, paged_mla_attention
    from deepinfer_jax.kernels.mla_reference import paged_mla_attention_reference

    R, dr = 512, 64
    key = jax.random.key(1)
    print("\n## Paged MLA decode attention (16 heads, 576-wide latent, page 64, bf16)")
    print("| batch | context | impl | us | TB/s of cache read | max err vs ref |")
    print("|---|---|---|---|---|---|")
    shapes = [(32, 768), (256, 2048)] if quick else [(1, 512), (1, 32768), (8, 4096), (32, 768), (32, 4096),
                                                     (128, 2048), (256, 512), (256, 2048)]
    for B, ctx in shapes:
        ql, qp, kv, sid, pos, pt = decode_attention_inputs(key, B, ctx, jnp.bfloat16)
        moved = B * ctx * (R + dr) * 2
        ref = None
        if B * ctx <= 256 * 2048:
            ref = np.asarray(jax.jit(lambda *a: paged_mla_attention_reference(*a, 0.1147))(
                ql, qp, kv, 0, sid, pos, pt).astype(jnp.float32))
        for splits in ["auto"] + ([] if os.environ.get("MLA_AUTO_ONLY") else [1, 4, 16] if B < 64 else [1, 2]):
            for bh, nw in ((16, 4), (16, 8)) if splits != "auto" else ((16, 8),):
                s_arg = None if splits == "auto" else splits
                label = f"auto={auto_splits(B)}" if splits == "auto" else splits
                fn = jax.jit(lambda *a, s=s_arg, bh=bh, nw=nw: paged_mla_attention(
                    *a, 0.1147, num_splits=s, block_h=bh, num_warps=nw))
                try:
                    t, out = bench(fn, ql, qp, kv, 0, sid, pos, pt)
                    err = max_err(out, ref)
                    print(f"| {B} | {ctx} | pallas splits{label} bh{bh} w{nw} | {t*1e6:.0f} | {moved/t/1e12:.2f} | {err} |",
                          flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"| {B} | {ctx} | pallas splits{label} | failed: {type(e).__name__}: {str(e)[:200]} |", flush=True)
        if ref is not None and not os.environ.get("MLA_AUTO_ONLY"):
            t, _ = bench(jax.jit(lambda *a: paged_mla_attention_reference(*a, 0.1147)), ql, qp, kv, 0, sid, pos, pt)
            print(f"| {B} | {ctx} | xla reference | {t*1e6:.0f} | {moved/t/1e12:.2f} | 0 |", flush=True)


def mla_output_table():
    """The decode attention's output kernel (splits merged, W_UV applied, kv_b read in place) against
    the XLA merge and einsum on the same splits, bf16 and fp32, V2-Lite heads."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.mla_decode import merge_splits, paged_mla_attention_splits
    from deepinfer_jax.kernels.mla_output import merge_value_projection, merge_value_projection_reference

    H, R, dn, dv, L = 16, 512, 128, 128, 27
    key = jax.random.key(2)
    print("\n## Decode attention output: splits merged + W_UV (kernels/mla_output.py; 16 heads, kv_b [27, 512, 16, 256])")
    print("| batch | context | dtype | kernel us | XLA merge + einsum us | max err vs reference | (max abs output) |")
    print("|---|---|---|---|---|---|---|")
    for B, ctx in ((16, 640), (32, 640), (64, 2048)):
        for dt in (jnp.bfloat16, jnp.float32):
            ql, qp, kv, sid, pos, pt = decode_attention_inputs(key, B, ctx, dt)
            kv_b = (jax.random.normal(jax.random.fold_in(key, 3), (L, R, H, dn + dv), jnp.float32) * 0.05).astype(dt)
            o, m, l = jax.jit(lambda *a: paged_mla_attention_splits(*a, 0.1147))(ql, qp, kv, 0, sid, pos, pt)
            ref = np.asarray(jax.jit(lambda *a: merge_value_projection_reference(*a, dn=dn, dtype=jnp.float32))(
                o, m, l, kv_b.astype(jnp.float32), 5))
            t_k, out = bench(jax.jit(lambda *a: merge_value_projection(*a, dn=dn, dtype=dt)), o, m, l, kv_b, 5)
            w_uv = kv_b[5, :, :, dn:]
            t_x, _ = bench(jax.jit(lambda o, m, l, w: jnp.einsum("thr,rhv->thv", merge_splits(o, m, l).astype(dt), w)),
                           o, m, l, w_uv)
            print(f"| {B} | {ctx} | {jnp.dtype(dt).name} | {t_k*1e6:.0f} | {t_x*1e6:.0f} | {max_err(out, ref)} | "
                  f"{np.abs(ref).max():.3g} |", flush=True)


def decode_attention_sweep(B: int = 32, ctx: int = 640):
    """Device time (profiler trace) of the decode attention's kernels at one batch and context over
    launch configurations: the attention kernel's context splits, warps and pipeline stages, and the
    output kernel's tiles (kernels/mla_output.py) on each split count, with XLA's merge + einsum
    beside them."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.mla_decode import merge_splits, paged_mla_attention_splits
    from deepinfer_jax.kernels.mla_output import merge_value_projection

    H, R, dn, dv, L = 16, 512, 128, 128, 27
    key = jax.random.key(4)
    ql, qp, kv, sid, pos, pt = decode_attention_inputs(key, B, ctx, jnp.bfloat16,
                                                       np.random.default_rng(1).integers(ctx - 128, ctx, B))
    kv_b = (jax.random.normal(jax.random.fold_in(key, 3), (L, R, H, dn + dv), jnp.float32) * 0.05).astype(jnp.bfloat16)
    total = lambda d: sum(d.values())  # noqa: E731
    print(f"\n## Decode attention at batch {B}, context {ctx - 128}-{ctx} (device us per call, profiler trace)")
    print("| attention splits / warps / stages | attention us | XLA merge + W_UV us | output kernel (bv, br, warps, stages): us |")
    print("|---|---|---|---|")
    attn_cfgs = [(4, 8, 2), (4, 4, 2), (4, 8, 1), (4, 4, 1), (2, 8, 2), (8, 8, 1), (8, 4, 1), (8, 8, 2)]
    out_cfgs = [(64, 64, 4, 3), (32, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 3), (32, 64, 2, 3),
                (64, 64, 8, 3), (32, 32, 4, 4), (16, 64, 4, 3)]
    for S, nw, st in attn_cfgs:
        try:
            fa = jax.jit(lambda *a, S=S, nw=nw, st=st: paged_mla_attention_splits(
                *a, 0.1147, num_splits=S, num_warps=nw, num_stages=st))
            t_attn = total(device_us(fa, ql, qp, kv, 0, sid, pos, pt))
            o, m, l = fa(ql, qp, kv, 0, sid, pos, pt)
            fx = jax.jit(lambda o, m, l, w: jnp.einsum("thr,rhv->thv", merge_splits(o, m, l).astype(jnp.bfloat16), w))
            t_xla = total(device_us(fx, o, m, l, kv_b[5, :, :, dn:]))
            cells = []
            for bv, br, w2, st2 in out_cfgs:
                fo = jax.jit(lambda *a, bv=bv, br=br, w2=w2, st2=st2: merge_value_projection(
                    *a, dn=dn, dtype=jnp.bfloat16, block_v=bv, block_r=br, num_warps=w2, num_stages=st2))
                try:
                    cells.append(f"({bv},{br},{w2},{st2}) {total(device_us(fo, o, m, l, kv_b, 5)):.1f}")
                except Exception as e:  # noqa: BLE001
                    cells.append(f"({bv},{br},{w2},{st2}) failed {type(e).__name__}")
            print(f"| {S} / {nw} / {st} | {t_attn:.1f} | {t_xla:.1f} | {'; '.join(cells)} |", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"| {S} / {nw} / {st} | failed: {type(e).__name__}: {str(e)[:160]} |", flush=True)


def ragged_step(rows, T: int, ps: int):
    """A ragged step of per-row (cached tokens, new tokens) laid out one after another, then padding to T:
    (page_table [S, max pages] over shuffled pages from 1, seq_ids [T], positions [T], real tokens, pages used)."""
    pages_per_seq = [-(-(c + n) // ps) for c, n in rows]
    perm = 1 + np.random.default_rng(0).permutation(sum(pages_per_seq))
    pt = np.zeros((len(rows), max(pages_per_seq)), np.int32)
    sid, pos, used, t = np.zeros(T, np.int32), np.zeros(T, np.int32), 0, 0
    for row, ((c, n), k) in enumerate(zip(rows, pages_per_seq)):
        pt[row, :k] = perm[used : used + k]
        used += k
        sid[t : t + n], pos[t : t + n] = row, np.arange(c, c + n)
        t += n
    return pt, sid, pos, t, used


def gqa_prefill_table(quick: bool):
    """The dense family's prefill attention (kernels/gqa_prefill.py, query blocks) at several tile configs against
    the kernel of a token a program (kernels/gqa_attention.py) and the XLA reference, Llama-3.1-8B's heads (32 / 8,
    head_dim 128) and Qwen2.5-7B's (28 / 4), page 64, bf16."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.gqa_attention import paged_gqa_attention
    from deepinfer_jax.kernels.gqa_prefill import ragged_gqa_attention
    from deepinfer_jax.kernels.gqa_reference import paged_gqa_attention_reference

    hd, ps, key = 128, 64, jax.random.key(3)
    print("\n## Paged GQA prefill attention (head_dim 128, page 64, bf16)")
    print("| heads | step | tokens | impl | config | us | TFLOP/s (causal) | max err vs ref |")
    print("|---|---|---|---|---|---|---|---|")
    steps = [("32 prompts x 512", [(0, 512)] * 32, 16384), ("4 prompts x 512", [(0, 512)] * 4, 2048)]
    if not quick:
        steps += [("512 after 3584 cached + 32 decodes at 2K", [(3584, 512)] + [(2047, 1)] * 32, 1024)]
    for H, KVH in ((32, 8), (28, 4)) if not quick else ((32, 8),):
        for name, rows, T in steps:
            pt, sid, pos, t, used = ragged_step(rows, T, ps)
            flops = 4 * H * hd * int((pos[:t] + 1).sum())  # QK^T + PV over the visible keys
            kv = jax.random.normal(key, (1, used + 1, ps, 2, KVH, hd), jnp.bfloat16)
            q = jax.random.normal(jax.random.fold_in(key, 1), (T, H, hd), jnp.bfloat16)
            args = (q, kv, 0, jnp.asarray(sid), jnp.asarray(pos), jnp.asarray(pt))
            ref_fn = jax.jit(lambda *a: paged_gqa_attention_reference(*a, hd ** -0.5))
            ref = np.asarray(ref_fn(*args).astype(jnp.float32))[:t]

            def row(impl, config, fn):
                try:
                    tm, out = bench(fn, *args)
                    print(f"| {H}/{KVH} | {name} | {T} | {impl} | {config} | {tm*1e6:.0f} | {flops/tm/1e12:.1f} | "
                          f"{max_err(np.asarray(out, np.float32)[:t], ref)} |", flush=True)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"| {H}/{KVH} | {name} | {T} | {impl} | {config} | failed: {type(e).__name__}: "
                          f"{str(e)[:200]} |", flush=True)

            for rws, bk, nw, ns in ((128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 4, 2), (128, 64, 4, 3),
                                    (256, 64, 8, 2), (64, 32, 4, 3)):
                row("pallas query blocks", f"rows{rws} bk{bk} w{nw} s{ns}", jax.jit(
                    lambda *a, r=rws, b=bk, w=nw, n=ns: ragged_gqa_attention(
                        *a, hd ** -0.5, rows=r, block_keys=b, num_warps=w, num_stages=n)))
            row("pallas token a program", "default", jax.jit(lambda *a: paged_gqa_attention(*a, hd ** -0.5)))
            row("xla reference", "-", ref_fn)


def mla_prefill_table(quick: bool):
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.kernels.mla_decode import paged_mla_attention
    from deepinfer_jax.kernels.mla_prefill import paged_mla_prefill_attention
    from deepinfer_jax.kernels.mla_reference import paged_mla_attention_reference

    H, R, dr, ps = 16, 512, 64, 64
    key = jax.random.key(2)
    print("\n## Paged MLA prefill attention (16 heads, 576-wide latent, page 64, bf16)")
    print("| step | tokens | impl | config | us | TFLOP/s (causal) | max err vs ref |")
    print("|---|---|---|---|---|---|---|")
    # name, per-row (cached tokens, new tokens), token bucket: rows laid out one after another, then padding.
    steps = [("16 prompts x 512", [(0, 512)] * 16, 8192),
             ("512 after 1536 cached", [(1536, 512)], 512)]
    if not quick:
        steps += [("2 x 512 after 3584 cached + 256 decodes at 2K", [(3584, 512)] * 2 + [(2047, 1)] * 256, 2048),
                  ("4 prompts x 128", [(0, 128)] * 4, 512)]
    for name, rows, T in steps:
        pt, sid, pos, t, used = ragged_step(rows, T, ps)
        flops = 2 * H * (R + dr + R) * int((pos[:t] + 1).sum())  # QK^T over 576 + PV over 512, visible keys only
        kv = jax.random.normal(key, (1, used + 1, ps, R + dr), jnp.bfloat16)
        ql = jax.random.normal(jax.random.fold_in(key, 1), (T, H, R), jnp.bfloat16)
        qp = jax.random.normal(jax.random.fold_in(key, 2), (T, H, dr), jnp.bfloat16)
        args = (ql, qp, kv, 0, jnp.asarray(sid), jnp.asarray(pos), jnp.asarray(pt))
        ref_fn = jax.jit(lambda *a: paged_mla_attention_reference(*a, 0.1147))
        ref = np.asarray(ref_fn(*args).astype(jnp.float32))

        def row(impl, config, fn):
            try:
                tm, out = bench(fn, *args)
                err = max_err(out, ref)
                print(f"| {name} | {T} | {impl} | {config} | {tm*1e6:.0f} | {flops/tm/1e12:.1f} | {err} |",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"| {name} | {T} | {impl} | {config} | failed: {type(e).__name__}: {str(e)[:200]} |", flush=True)

        configs = [(2, 8, 2, 1), (2, 4, 2, 1), (2, 8, 3, 1), (4, 8, 2, 1), (4, 8, 1, 1), (1, 8, 2, 1)]
        if T <= 512:
            configs += [(2, 8, 2, 4)]
        for bq, nw, ns, sp in configs:
            row("pallas prefill", f"bq{bq} bh16 w{nw} s{ns} splits{sp}", jax.jit(
                lambda *a, bq=bq, nw=nw, ns=ns, sp=sp: paged_mla_prefill_attention(
                    *a, 0.1147, block_q=bq, block_h=16, num_warps=nw, num_stages=ns, num_splits=sp)))
        for sp in (1, 4):
            row("pallas decode", f"splits{sp} bh16 w8", jax.jit(
                lambda *a, sp=sp: paged_mla_attention(*a, 0.1147, num_splits=sp, block_h=16, num_warps=8)))
        row("xla reference", "-", ref_fn)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=None, choices=["moe", "moe_prefill", "mla", "mla_output", "mla_prefill",
                                                     "decode_sweep", "gqa_prefill"])
    ap.add_argument("--moe-tokens", default="", help="comma-separated token counts for the MoE table")
    args = ap.parse_args(argv)
    import jax

    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    if args.only in (None, "moe"):
        moe_tables(args.quick, [int(t) for t in args.moe_tokens.split(",") if t] or None)
    if args.only == "moe_prefill":  # not part of the default tables; --moe-tokens: only the engine's rows at each
        for T in [int(t) for t in args.moe_tokens.split(",") if t] or [16384]:
            moe_prefill_sweep(T, engine_only=bool(args.moe_tokens))
    if args.only in (None, "mla"):
        mla_tables(args.quick)
    if args.only in (None, "mla_output"):
        mla_output_table()
    if args.only == "decode_sweep":  # not part of the default tables
        decode_attention_sweep(32, 640)
        decode_attention_sweep(64, 2048)
    if args.only in (None, "mla_prefill"):
        mla_prefill_table(args.quick)
    if args.only in (None, "gqa_prefill"):
        gqa_prefill_table(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
