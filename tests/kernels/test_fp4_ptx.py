"""kernels/fp4.py's PTX decode (`PAIRS_PTX`), run instruction by instruction by a small emulator of the PTX it
uses, against the integer-op decode the CPU paths run: every byte value at every position of the word, with
scales across e8m0's range. (The GPU run of benchmarks/fp4_experts.py checks the compiled block against the
reference as well.)"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import jax.numpy as jnp

from deepinfer_jax.kernels.fp4 import PAIRS_PTX, e8m0_to_float, nibble_values

M32 = 0xFFFFFFFF


def _bf16_pair(a: int) -> np.ndarray:
    return np.array([a & 0xFFFF, a >> 16], np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)


def _prmt(a: int, b: int, c: int) -> int:
    """prmt.b32's default mode: each result byte is byte (selector & 7) of b:a (bit 3: its sign replicated)."""
    src = (b << 32) | a
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 15
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _run(ptx: str, ins: list[int], n_out: int) -> list[int]:
    regs = {f"${n_out + i}": v for i, v in enumerate(ins)}

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 0) & M32

    for line in ptx.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *srcs = [t.strip() for t in rest.split(",")]
        v = [val(t) for t in srcs]
        if op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "shr.u32":
            r = v[0] >> v[1]
        elif op == "mov.b32":
            r = v[0]
        elif op == "prmt.b32":
            r = _prmt(*v)
        elif op == "fma.rn.bf16x2":
            f = _bf16_pair(v[0]) * _bf16_pair(v[1]) + _bf16_pair(v[2])
            h = f.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.int64)
            r = int(h[0]) | (int(h[1]) << 16)
        else:
            raise AssertionError(f"the emulator lacks {op}")
        regs[dst] = r & M32
    return [regs[f"${i}"] for i in range(n_out)]


def test_pairs_ptx_matches_the_integer_decode():
    assert not set(re.findall(r"^\s*([a-z][\w.]*)", PAIRS_PTX, re.M)) - {
        "and.b32", "or.b32", "shr.u32", "mov.b32", "prmt.b32", "fma.rn.bf16x2"}
    rng = np.random.default_rng(0)
    n = 1024
    words = rng.integers(0, 256, (n, 4), dtype=np.uint8)
    words[:256, :] = np.arange(256, dtype=np.uint8)[:, None]  # every byte value at every position
    # e8m0's range down to 2 ** -125 (below it 0.5 x scale is an fp32 denormal, which XLA flushes to zero)
    scale_bytes = rng.integers(2, 255, (n, 4)).astype(np.uint8)
    scale_bytes[:4, 0] = [2, 127, 200, 254]
    scales = np.asarray(e8m0_to_float(jnp.asarray(scale_bytes)))
    lo_want, hi_want = (np.asarray(a).view(np.uint16) for a in nibble_values(
        jnp.asarray(words), jnp.asarray(scales), jnp.bfloat16, asm=False))
    sb = scales.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.int64)
    for w in range(n):
        word = int(words[w].view("<u4")[0])
        s01, s23 = int(sb[w, 0] | sb[w, 1] << 16), int(sb[w, 2] | sb[w, 3] << 16)
        out = _run(PAIRS_PTX, [word, s01, s23], 4)
        lo = [out[0] & 0xFFFF, out[0] >> 16, out[1] & 0xFFFF, out[1] >> 16]
        hi = [out[2] & 0xFFFF, out[2] >> 16, out[3] & 0xFFFF, out[3] >> 16]
        assert lo == lo_want[w].tolist() and hi == hi_want[w].tolist(), (w, words[w], scale_bytes[w])
