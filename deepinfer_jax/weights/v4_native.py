"""DeepSeek-V4 checkpoints in their released formats: FP8 block-scaled linears and FP4 routed experts.

As DeepSeek releases V4 (docs/v4.md "Weights as released"): config.json's `quantization_config`
{"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [bn, bk]} and a top-level
`expert_dtype` ("fp4": V4-Flash / Pro; "fp8" or absent: FP8 experts, as V4-Flash-Base). A quantized tensor
`X.weight` comes with `X.scale` (DeepSeek's name; HF's is `X.weight_scale_inv`, both read):
- FP8 (F8_E4M3 [N, K]): scales [cdiv(N, bn), cdiv(K, bk)], F8_E8M0 (powers of two) or F32.
- FP4 routed experts (I8 [N, K / 2], two e2m1 codes a byte): scales [N, cdiv(K, 32)], F8_E8M0 (or F32 / BF16
  holding powers of two).
Which tensors are quantized is read from each tensor's dtype, not assumed: any linear the name table knows may
be FP8; only routed experts may be FP4.

"auto" keeps them: an FP8 leaf is a models/quant.py `Fp8Weight` (fp32 block scales; HF's [out, in]
orientation, gate and up apart), an FP4 leaf an `Fp4Weight` (the packed bytes and e8m0 scale bytes as stored,
so the device holds the file's bytes). "none" dequantizes them into the float leaves (exact in fp32). The
grouped o_a_proj [g, H*hd/g, r] is one HF matrix [g*r, H*hd/g] whose blocks may straddle groups: kept as one
Fp8Weight of logical shape [H*hd/g, g, r] (in (H*hd/g,), out (g, r)); v4_attention moves g in front after
dequantizing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import ml_dtypes
import numpy as np

from deepinfer_jax.models.quant import Fp8Weight
from deepinfer_jax.models.quant_fp4 import FP4_GROUP, Fp4Weight
from deepinfer_jax.weights.name_table import TensorRule
from deepinfer_jax.weights.safetensors_io import CheckpointError, TensorInfo, load_tensor

FP8_Q = ("F8_E4M3",)
FP4_Q = ("I8", "U8")
SCALE_DTYPES = ("F8_E8M0", "F32", "BF16")


@dataclasses.dataclass(frozen=True)
class V4Quant:
    """What config.json says of a released V4 checkpoint: the FP8 block (bn rows, bk columns) and the experts'
    format ("fp4" or "fp8")."""
    block: tuple[int, int]
    expert_dtype: str


def v4_quant_config(hf: dict) -> V4Quant | None:
    """The checkpoint's format from config.json, None for a float checkpoint."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"quantization_config quant_method {method!r} is not a DeepSeek-V4 release format "
                              "(expected 'fp8': FP8 linears, FP4 experts under expert_dtype 'fp4')")
    ed = hf.get("expert_dtype") or "fp8"
    if ed not in ("fp4", "fp8"):
        raise CheckpointError(f"expert_dtype {ed!r} is not one of 'fp4', 'fp8'")
    b = qc.get("weight_block_size") or [128, 128]
    return V4Quant((int(b[0]), int(b[1])), ed)


def scale_aliases(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """DeepSeek's `X.scale` under HF's name `X.weight_scale_inv` where `X.weight` exists (a hyper-connection's
    own `scale` parameter has no such sibling and keeps its name)."""
    out = {}
    for name, info in tensors.items():
        base = name[: -len(".scale")] if name.endswith(".scale") else None
        if base is not None and base + ".weight" in tensors:
            name = base + ".weight_scale_inv"
        if name in out:
            raise CheckpointError(f"checkpoint names tensor {name} twice (as {out[name].name} and {info.name})")
        out[name] = info
    return out


def _is_expert(path: tuple) -> bool:
    return len(path) >= 2 and path[-2] == "experts"


def stored_kind(rule: TensorRule, info: TensorInfo) -> str:
    """"fp8" | "fp4" for a quantized tensor of `rule`, "float" otherwise (other dtypes are the caller's to judge)."""
    if info.dtype in FP8_Q:
        return "fp8"
    if info.dtype in FP4_Q and _is_expert(rule.path):
        return "fp4"
    return "float"


def check_quantized(rule: TensorRule, info: TensorInfo, tensors: dict[str, TensorInfo], quant: V4Quant | None
                    ) -> str:
    """The quantized tensor of `rule` and its scales, checked (shapes, dtypes, config); returns its kind."""
    kind = stored_kind(rule, info)
    name = rule.hf_name
    if kind == "float":
        raise CheckpointError(f"tensor {name} has dtype {info.dtype}; expected a float dtype, F8_E4M3, or I8 "
                              "(FP4) for a routed expert")
    if quant is None:
        raise CheckpointError(f"tensor {name} is {info.dtype} but config.json has no quantization_config")
    if len(rule.hf_shape) != 2:
        raise CheckpointError(f"tensor {name} is {info.dtype} {info.shape}: quantized experts must be 2-D "
                              "[out, in] tensors (per-expert names), not a fused expert layout")
    N, K = rule.hf_shape
    if kind == "fp8":
        bn, bk = quant.block
        want_q, want_s = (N, K), (math.ceil(N / bn), math.ceil(K / bk))
    else:
        if K % 2:
            raise CheckpointError(f"tensor {name} is FP4 with an odd input size {K}")
        want_q, want_s = (N, K // 2), (N, math.ceil(K / FP4_GROUP))
    if info.shape != want_q:
        raise CheckpointError(f"tensor {name} has shape {info.shape}, expected {want_q} ({kind} of a {N} x {K} "
                              "weight)")
    scale = tensors.get(name + "_scale_inv")
    if scale is None:
        raise CheckpointError(f"tensor {name} is {info.dtype} without its scales ({name[:-len('.weight')]}.scale)")
    if scale.shape != want_s:
        raise CheckpointError(f"tensor {scale.name} has shape {scale.shape}, expected {want_s} for {name} ({kind}"
                              + (f", weight_block_size {list(quant.block)})" if kind == "fp8" else ", 1 x 32 groups)"))
    if scale.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"tensor {scale.name} has dtype {scale.dtype}; expected one of {SCALE_DTYPES}")
    return kind


def e8m0_bytes(scale: np.ndarray, name: str) -> np.ndarray:
    """Scales as e8m0 bytes (2 ** (b - 127)): F8_E8M0 as stored; floats must be powers of two (exact)."""
    if scale.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        return scale.view(np.uint8)
    s = scale.astype(np.float32)
    mant, exp = np.frexp(s)
    b = exp - 1 + 127
    if not (np.all(mant == 0.5) and np.all((b >= 0) & (b <= 254))):
        raise CheckpointError(f"tensor {name} holds scales that are not powers of two (FP4 needs e8m0 scales)")
    return b.astype(np.uint8)


def read_quantized(rule: TensorRule, tensors: dict[str, TensorInfo], kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(q, scale) of `rule` as the leaf holds them: FP8 e4m3 [N, K] + fp32; FP4 uint8 [N, K / 2] + e8m0 bytes."""
    q = load_tensor(tensors[rule.hf_name])
    sinfo = tensors[rule.hf_name + "_scale_inv"]
    s = load_tensor(sinfo)
    if kind == "fp8":
        return np.asarray(q), np.asarray(s).astype(np.float32)
    return np.asarray(q).view(np.uint8), e8m0_bytes(np.asarray(s), sinfo.name)


def dequantized(rule: TensorRule, tensors: dict[str, TensorInfo], kind: str, quant: V4Quant) -> np.ndarray:
    """The fp32 HF [N, K] weight of a quantized tensor (exact)."""
    from deepinfer_jax.models.quant_fp4 import E2M1_VALUES
    from deepinfer_jax.weights.hf_loader import dequantize_fp8_blocks

    q, s = read_quantized(rule, tensors, kind)
    if kind == "fp8":
        return dequantize_fp8_blocks(q, s, quant.block)
    lut = np.array(E2M1_VALUES, np.float32)
    v = np.stack([lut[q & 15], lut[q >> 4]], axis=-1).reshape(q.shape[0], -1)
    scale = np.ldexp(np.float32(1.0), s.astype(np.int32) - 127).astype(np.float32)
    return v * np.repeat(scale, FP4_GROUP, axis=-1)[:, : v.shape[-1]]


# ---- leaves -------------------------------------------------------------------------------------------


def leaf_layout(path: tuple, shape: tuple[int, ...]) -> tuple[tuple, tuple, tuple, int]:
    """(lead, in_shape, out_shape, parts) of the quantized leaf at `path` whose float spec has `shape`."""
    if path[-1] == "o_a_proj":  # [g, K, r]: one HF matrix [g*r, K] (module docstring)
        g, K, r = shape
        return (), (K,), (g, r), 1
    nl = 1 if _is_expert(path) else 0
    return tuple(shape[:nl]), (shape[nl],), tuple(shape[nl + 1:]), 2 if path[-1] == "gate_up" else 1


def leaf_shapes(kind: str, path: tuple, shape: tuple[int, ...], quant: V4Quant
                ) -> tuple[tuple, Any, tuple, Any, Any]:
    """(q shape, q dtype, scale shape, scale dtype, make(q, scale) -> the leaf) of a quantized leaf."""
    lead, ins, outs, parts = leaf_layout(path, shape)
    K = ins[0]
    rows = (parts, math.prod(outs[1:])) if parts > 1 else (math.prod(outs),)
    if kind == "fp8":
        bn, bk = quant.block
        q = lead + rows + (K,)
        s = lead + rows[:-1] + (math.ceil(rows[-1] / bn), math.ceil(K / bk))
        return q, ml_dtypes.float8_e4m3fn, s, np.float32, lambda a, b: Fp8Weight(a, b, quant.block, ins, outs, parts)
    q = lead + rows + (K // 2,)
    s = lead + rows + (math.ceil(K / FP4_GROUP),)
    return q, np.uint8, s, np.uint8, lambda a, b: Fp4Weight(a, b, FP4_GROUP, ins, outs, parts)


def quant_index(rule: TensorRule) -> tuple:
    """Where `rule`'s HF matrix goes in its leaf's q / scale: (expert,) and (part,) where the leaf has them."""
    idx = (rule.index[0],) if _is_expert(rule.path) else ()
    return idx + ((rule.index[-1],) if rule.path[-1] == "gate_up" else ())


def leaf_kinds(rules: list[TensorRule], kinds: dict[str, str]) -> dict[tuple, str]:
    """path -> "fp8" | "fp4" for every leaf stored quantized; a leaf whose tensors mix formats is refused."""
    seen: dict[tuple, set] = {}
    for r in rules:
        seen.setdefault(r.path, set()).add(kinds[r.hf_name])
    out = {}
    for path, ks in seen.items():
        if len(ks) > 1:
            names = [r.hf_name for r in rules if r.path == path][:2]
            raise CheckpointError(f"tensors of one weight are stored in different formats ({sorted(ks)}), e.g. "
                                  f"{names}")
        if ks != {"float"}:
            out[path] = ks.pop()
    return out


def abstract_leaf(kind: str, path: tuple, spec_shape: tuple, quant: V4Quant, sharding: Any,
                  axes: tuple | None = None) -> Any:
    """The Fp8Weight / Fp4Weight of ShapeDtypeStructs a kept leaf loads as; its float leaf's `sharding` (a mesh
    layout: split as sharding/packed.py lays out q and scale; `axes` the float leaf's logical axes, for its
    refusal)."""
    from jax.sharding import NamedSharding

    qs, qd, ss, sd, make = leaf_shapes(kind, path, spec_shape, quant)
    if not isinstance(sharding, NamedSharding):
        return make(jax.ShapeDtypeStruct(qs, qd, sharding=sharding), jax.ShapeDtypeStruct(ss, sd, sharding=sharding))
    from deepinfer_jax.sharding.packed import packed_sharding

    w = make(jax.ShapeDtypeStruct(qs, qd), jax.ShapeDtypeStruct(ss, sd))
    sh = packed_sharding(w, sharding, axes, ".".join(map(str, path)))
    return dataclasses.replace(w, q=jax.ShapeDtypeStruct(qs, qd, sharding=sh.q),
                               scale=jax.ShapeDtypeStruct(ss, sd, sharding=sh.scale))
