"""Registers, spills and shared memory of the decode step's Triton kernels on an H200, without a GPU.

Two steps, two Pythons:

    .venv/bin/python benchmarks/kernel_resources.py dump DIR       # the project's venv: lowers each kernel at
                                                                   # V2-Lite's batch-32 decode shapes (--prefill:
                                                                   # Protocol A's prefill step) for sm_90 and
                                                                   # writes its Triton IR and launch parameters
    .ptx-venv/bin/python benchmarks/kernel_resources.py report DIR # a venv with the `triton` package
                                                                   # (bash scripts/ptx_tools.sh makes it): compiles
                                                                   # each IR to PTX for sm_90a, runs ptxas -v and
                                                                   # prints a table

The figures come from Triton's own compiler (the `triton` wheel's version, not the one XLA bundles), so
they are indicative: XLA's pipeline may allocate a few registers differently. They answer what a GPU-less
machine can: whether a kernel spills, how many CTAs of it fit on an SM (65,536 registers, 227 KB of shared
memory), and how a change of warps or stages moves both. The report mode imports no JAX.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SM_REGISTERS, SM_SHARED, SM_THREADS = 65536, 227 * 1024, 2048


def _cases():
    """(name, fn, args) at V2-Lite's shapes, batch 32 (the kernels' defaults for warps and stages)."""
    import jax.numpy as jnp
    from jax import ShapeDtypeStruct as s

    from deepinfer_jax.kernels import (decode_matmul, mla_absorb, mla_decode, mla_output, moe_route, residual_route,
                                       route_experts)

    H, R, DR, PS, L, T, D = 16, 512, 64, 64, 27, 32, 2048
    Lm, E, I, S = 26, 64, 1408, 2
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    cache = s((L, 40000, PS, R + DR), bf)
    splits = mla_decode.auto_splits(T)
    o, ml = s((T, 1, splits, H, R), f32), s((T, 1, splits, H), f32)
    moe = (s((T, D), bf), s((T, E), f32), s((Lm, E, D, 2, I), bf), s((Lm, E, I, D), bf), s((), i32),
           s((Lm, D, 2, S * I), bf), s((Lm, S * I, D), bf))
    return [
        ("attention splits", lambda ql, qp, c, sid, pos, pt: mla_decode.paged_mla_attention_splits(
            ql, qp, c, 3, sid, pos, pt, 0.1, pages_per_step=mla_decode.PAGES_PER_STEP),
         (s((T, H, R), bf), s((T, H, DR), bf), cache, s((T,), i32), s((T,), i32), s((T, 16), i32))),
        ("merge + W_UV", lambda o, m, l, kv_b: mla_output.merge_value_projection(o, m, l, kv_b, 3, dn=128, dtype=bf),
         (o, ml, ml, s((L, R, H, 256), bf))),
        ("o_proj (decode_matmul)", lambda x, w: decode_matmul.decode_matmul(x, w, 3, reduce=False),
         (s((T, H * 128), bf), s((L, H * 128, D), bf))),
        ("absorb + latents (merged q / kv_a read in place)", lambda q, kv_b, c, sn, nw, cch, sl:
            mla_absorb.absorb_query_write_latents(q, kv_b, 3, c, sn, None, nw, cch, 4, sl, dn=128, eps=1e-6),
         (s((T, H * 192 + R + DR), bf), s((L, R, H, 256), bf), s((T, DR // 2), f32), s((T, DR // 2), f32),
          s((L, R), bf), cache, s((T,), i32))),
        ("partials -> routing", lambda p, h, nw, g: residual_route.residual_route(
            p, h, nw, g, 5, eps=1e-6, k=6, num_shared=2, block_m=16),
         (s((8, T, D), f32), s((T, D), bf), s((Lm, D), bf), s((Lm, D, E), bf))),
        ("routing + MoE single launch", lambda x, lg, a, d, l, sa, sd: moe_route.moe_fused_decode(
            x, lg, None, a, d, l, sa, sd, k=6, single_launch=True), moe),
        ("partials -> routing -> experts (the MoE launch)", lambda p, h, nw, g, a, d, sa, sd:
            route_experts.route_experts(p, h, nw, g, 5, a, d, sa, sd, eps=1e-6, k=6, shared_tiles=(32, 64, 256)),
         (s((8, T, D), f32), s((T, D), bf), s((Lm, D), bf), s((Lm, D, E), bf), *moe[2:4], *moe[5:])),
    ]


def _prefill_cases():
    """(name, fn, args) of a Protocol A prefill step: 32 prompts x 512 tokens in the 16,384-token bucket."""
    import jax.numpy as jnp
    from jax import ShapeDtypeStruct as s

    from deepinfer_jax.kernels import mla_chunk, mla_prefill, moe_gmm

    H, R, DR, PS, L, T, D, S = 16, 512, 64, 64, 27, 16384, 2048, 32
    Lm, E, I, k = 26, 64, 1408, 6
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32

    def split(qn, qp, kv, kp, ql, cache, sid, pos, pt):  # models/mla_split.py attend_split's kernels
        rs = mla_prefill.run_starts(sid, pos)
        blocks = mla_prefill.query_blocks(sid, pos, 64, mla_prefill.num_query_blocks_bound(T, S, 64))
        chunk = mla_chunk.chunk_attention(qn, qp, kv, kp, rs, blocks, 0.1, block_q=64)
        ctx = mla_prefill.paged_mla_prefill_attention(ql, qp, cache, 0, sid, pos, pt, 0.1, visible_to=pos[rs] - 1,
                                                      return_lse=True)
        return chunk, ctx

    return [
        ("prefill attention", split,
         (s((T, H, 128), bf), s((T, H, DR), bf), s((T, H, 256), bf), s((T, DR), bf), s((T, H, R), bf),
          s((L, 8000, PS, R + DR), bf), s((T,), i32), s((T,), i32), s((S, 16), i32))),
        ("prefill MoE", lambda x, a, b, w, i, l, sa, sb: moe_gmm.moe_experts(x, a, b, w, i, l, shared_gate_up=sa,
                                                                              shared_down=sb),
         (s((T, D), bf), s((Lm, E, D, 2, I), bf), s((Lm, E, I, D), bf), s((T, k), f32), s((T, k), i32), s((), i32),
          s((Lm, D, 2, 2 * I), bf), s((Lm, 2 * I, D), bf))),
    ]


def dump(out: str, prefill: bool = False) -> None:
    """Lower every case (the decode step's, or with `prefill` a prefill step's) for an sm_90 device and write
    DIR/NN.ttir plus DIR/kernels.json (name, warps, stages, grid of each kernel, in launch order within its
    case)."""
    import jax
    from jax._src.pallas.triton import pallas_call_registration as reg

    class _H200:
        compute_capability = "9.0"

    lower, info, captured = reg.lowering.lower_jaxpr_to_triton_module, reg.gpu_info_lib.get_gpu_info, []

    def capture(*a, **k):
        res = lower(*a, **k)
        caller = sys._getframe(1).f_locals  # pallas_call_lowering's: the launch parameters it chose
        captured.append((res.module.operation.get_asm(), caller["num_warps"], caller["num_stages"], list(res.grid)))
        return res

    reg.gpu_info_lib.get_gpu_info, reg.lowering.lower_jaxpr_to_triton_module = (lambda: _H200()), capture
    os.makedirs(out, exist_ok=True)
    index = []
    try:
        for case, fn, args in (_prefill_cases() if prefill else _cases()):
            captured.clear()
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
            for i, (ir, warps, stages, grid) in enumerate(captured):
                path = f"{len(index):02d}.ttir"
                with open(os.path.join(out, path), "w") as f:
                    f.write(ir)
                name = case if len(captured) == 1 else f"{case} [{i + 1}/{len(captured)}]"
                index.append(dict(name=name, ttir=path, num_warps=warps, num_stages=stages, grid=grid))
    finally:
        reg.gpu_info_lib.get_gpu_info, reg.lowering.lower_jaxpr_to_triton_module = info, lower
    with open(os.path.join(out, "kernels.json"), "w") as f:
        json.dump(index, f, indent=1)
    print(f"{len(index)} kernels in {out}")


def _ptxas(triton_dir: str) -> str:
    """The ptxas that reads the PTX version this Triton writes (the newest of the wheel's)."""
    bin_dir = os.path.join(triton_dir, "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        if os.path.exists(os.path.join(bin_dir, name)):
            return os.path.join(bin_dir, name)
    raise FileNotFoundError(f"no ptxas under {bin_dir}")


def report(out: str, warps: int | None, stages: int | None) -> None:
    """Compile each dumped kernel (optionally at other warps / stages) and print registers, spills, shared
    memory and the CTAs an SM holds."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget

    ptxas = _ptxas(os.path.dirname(triton.__file__))
    print("| kernel | grid | warps | stages | registers | spill stores / loads (B) | shared (KB) | CTAs / SM |")
    print("|---|---|---|---|---|---|---|---|")
    for k in json.load(open(os.path.join(out, "kernels.json"))):
        w, st = warps or k["num_warps"], stages or k["num_stages"]
        compiled = triton.compile(os.path.join(out, k["ttir"]), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": w, "num_stages": st})
        ptx = os.path.join(out, f"{k['ttir']}.w{w}s{st}.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True,
                              text=True).stderr
        regs = int(re.search(r"Used (\d+) registers", info).group(1))
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info).groups()
        shared = compiled.metadata.shared
        threads = 32 * w
        ctas = min(SM_REGISTERS // (regs * threads), SM_THREADS // threads,
                   SM_SHARED // shared if shared else 32)
        grid = "x".join(str(g) for g in k["grid"] if g > 1) or "1"
        print(f"| {k['name']} | {grid} | {w} | {st} | {regs} | {spills[0]} / {spills[1]} | {shared / 1024:.1f} | {ctas} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["dump", "report"])
    ap.add_argument("dir")
    ap.add_argument("--prefill", action="store_true", help="dump: a Protocol A prefill step's kernels instead")
    ap.add_argument("--num-warps", type=int, default=None, help="report: compile every kernel at these warps")
    ap.add_argument("--num-stages", type=int, default=None, help="report: compile every kernel at these stages")
    args = ap.parse_args(argv)
    if args.mode == "dump":
        sys.path.insert(0, os.path.dirname(HERE))
        dump(args.dir, args.prefill)
    else:
        report(args.dir, args.num_warps, args.num_stages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
