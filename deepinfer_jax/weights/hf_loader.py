"""Load a Hugging Face DeepSeek directory (config.json + *.safetensors) into the params pytree.

Streaming: tensors are read one at a time from memory-mapped files, transformed into the engine's
layout, and written into device leaves with donated in-place updates, so host memory holds at most
one tensor (never a second copy of the model). Small models on CPU devices are assembled in host
memory instead and put on the devices leaf by leaf (`host_assembly`). Supports bf16 / fp16 / fp32 tensors, per-expert and
HF v5 fused expert layouts, and DeepSeek-V3 FP8 e4m3 weights with `weight_scale_inv` blocks of any size.

`quantization` follows vLLM's `--quantization`: None ("auto") keeps an FP8 checkpoint's weights as FP8 plus
their scales on the device (`Fp8Weight`, models/quant.py: each HF tensor's own blocks), "none" dequantizes
them to the engine dtype at load, "fp8" keeps them, or quantizes a float checkpoint's linear weights online
to 128 x 128 blocks. On a mesh the kept weights load split as their float leaves are (sharding/packed.py: `q` and
its block scales on the same devices); a layout whose split would cut a scale block is refused before any load.

Every expected tensor must be present with its exact shape and a float dtype; otherwise a
CheckpointError names it. Nothing is ever left randomly initialised.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.params import ParamSpec, is_spec, spec_dtype
from deepinfer_jax.models.quant import (FP8_BLOCK, FP8_PARTS_LEAVES, Fp8Weight, fp8_layout, fp8_quantize_blocks,
                                       quant_layout)
from deepinfer_jax.models.registry import param_specs
from deepinfer_jax.weights.name_table import TensorRule, expected_tensors, is_ignored
from deepinfer_jax.weights.pending import PendingParams, abstract_from_specs, in_host_memory
from deepinfer_jax.weights.safetensors_io import CheckpointError, TensorInfo, index_checkpoint, load_tensor

log = logging.getLogger(__name__)

FLOAT_DTYPES = ("F32", "BF16", "F16")
FP8_DTYPES = ("F8_E4M3",)
_E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def dequantize_fp8_blocks(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """W[i, j] = float(Wq[i, j]) * scale_inv[i // bm, j // bn]; edge blocks may be partial. -> fp32.

    The e4m3 bytes index a 256-entry table and the scales broadcast over [rows / bm, bm, cols / bn, bn] blocks,
    about 3x faster than widening through ml_dtypes and repeating the scales to the weight's size."""
    bm, bn = block
    m, n = w.shape
    if scale_inv.shape != (math.ceil(m / bm), math.ceil(n / bn)):
        raise CheckpointError(
            f"weight_scale_inv shape {scale_inv.shape} does not fit a {w.shape} weight with {block} blocks"
        )
    x = _E4M3_TO_F32[np.ascontiguousarray(w).view(np.uint8)]
    rows, cols = scale_inv.shape[0] * bm, scale_inv.shape[1] * bn
    if (rows, cols) != (m, n):
        x = np.pad(x, ((0, rows - m), (0, cols - n)))
    x = x.reshape(scale_inv.shape[0], bm, scale_inv.shape[1], bn)
    x *= scale_inv.astype(np.float32)[:, None, :, None]
    x = x.reshape(rows, cols)
    return x if (rows, cols) == (m, n) else np.ascontiguousarray(x[:m, :n])


def fp8_block_shape(model_dir_config: dict | None) -> tuple[int, int]:
    qc = (model_dir_config or {}).get("quantization_config") or {}
    b = qc.get("weight_block_size") or [128, 128]
    return int(b[0]), int(b[1])


def read_rule_tensor(rule: TensorRule, tensors: dict[str, TensorInfo], fp8_block: tuple[int, int]) -> np.ndarray:
    """The HF tensor for `rule`, checked, FP8-dequantized and transformed into the engine layout."""
    info = tensors.get(rule.hf_name)
    if info is None:
        raise CheckpointError(f"checkpoint is missing tensor {rule.hf_name}")
    if info.shape != rule.hf_shape:
        raise CheckpointError(f"tensor {rule.hf_name} has shape {info.shape}, expected {rule.hf_shape}")
    w = load_tensor(info)
    if info.dtype in FP8_DTYPES:
        scale = tensors.get(rule.hf_name + "_scale_inv")
        if not rule.quantizable or scale is None or w.ndim != 2:
            raise CheckpointError(f"tensor {rule.hf_name} is {info.dtype} without a usable weight_scale_inv")
        w = dequantize_fp8_blocks(w, load_tensor(scale), fp8_block)
    elif info.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {rule.hf_name} has dtype {info.dtype}; expected one of {FLOAT_DTYPES + FP8_DTYPES}")
    return rule.transform(w)


def check_scale(name: str, shape: tuple[int, ...], tensors: dict[str, TensorInfo], block: tuple[int, int]) -> None:
    """The weight_scale_inv of FP8 tensor `name` [.., N, K]: present, float, [.., cdiv(N, bn), cdiv(K, bk)]."""
    scale = tensors.get(name + "_scale_inv")
    if scale is None:
        raise CheckpointError(f"tensor {name} is F8_E4M3 without a usable weight_scale_inv ({name}_scale_inv is missing)")
    want = tuple(shape[:-2]) + (math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
    if scale.shape != want:
        raise CheckpointError(f"tensor {scale.name} has shape {scale.shape}, expected {want} for the {shape} weight "
                              f"with weight_block_size {list(block)}")
    if scale.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {scale.name} has dtype {scale.dtype}; expected one of {FLOAT_DTYPES}")


def check_tensors(rules: list[TensorRule], tensors: dict[str, TensorInfo],
                  fp8_block: tuple[int, int] | None = None) -> None:
    """Presence, shape and dtype of every expected tensor (and, given `fp8_block`, of every FP8 tensor's
    scales), naming the first bad one."""
    for rule in rules:
        info = tensors.get(rule.hf_name)
        if info is None:
            raise CheckpointError(f"checkpoint is missing tensor {rule.hf_name}")
        if info.shape != rule.hf_shape:
            raise CheckpointError(f"tensor {rule.hf_name} has shape {info.shape}, expected {rule.hf_shape}")
        if info.dtype in FP8_DTYPES:
            if not rule.quantizable or rule.hf_name + "_scale_inv" not in tensors:
                raise CheckpointError(f"tensor {rule.hf_name} is {info.dtype} without a usable weight_scale_inv")
            if len(info.shape) != 2:
                raise CheckpointError(f"tensor {rule.hf_name} is {info.dtype} {info.shape}: FP8 weights must be "
                                      "2-D [out, in] tensors (per-expert names), not a fused expert layout")
            if fp8_block is not None:
                check_scale(rule.hf_name, info.shape, tensors, fp8_block)
        elif info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {rule.hf_name} has dtype {info.dtype}; expected one of {FLOAT_DTYPES + FP8_DTYPES}")


QUANTIZATION_MODES = ("auto", "none", "fp8")


def fp8_leaf_paths(rules: list[TensorRule], tensors: dict[str, TensorInfo], quantization: str | None
                   ) -> tuple[frozenset, bool]:
    """(paths of the param leaves loaded as Fp8Weight, whether they are quantized online from float tensors).
    An FP8 checkpoint keeps every leaf whose tensors are all FP8 (a leaf mixing FP8 and float tensors is
    dequantized); `quantization="fp8"` on a float checkpoint quantizes every quantizable leaf."""
    mode = quantization or "auto"
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES} for a Hugging Face checkpoint, got {mode!r}")
    by_path: dict[tuple, list[TensorRule]] = {}
    for r in rules:
        by_path.setdefault(r.path, []).append(r)
    fp8_ckpt = any(tensors[r.hf_name].dtype in FP8_DTYPES for r in rules)
    if mode == "none" or (mode == "auto" and not fp8_ckpt):
        return frozenset(), False
    out = set()
    for path, rs in by_path.items():
        if quant_layout(path) is None or not all(r.quantizable for r in rs):
            continue
        fp8 = [tensors[r.hf_name].dtype in FP8_DTYPES for r in rs]
        if all(fp8) if fp8_ckpt else True:
            out.add(path)
    return frozenset(out), not fp8_ckpt


def fp8_abstract(path: tuple, spec: ParamSpec, block: tuple[int, int], sharding: Any) -> Fp8Weight:
    """The Fp8Weight of jax.ShapeDtypeStruct that the leaf at `path` loads as, its q and scale split as the float
    leaf's `sharding` splits it (sharding/packed.py; a ValueError where a split would cut a scale block)."""
    from deepinfer_jax.sharding.packed import packed_sharding

    n_in, n_out = quant_layout(path)
    q, s, ins, outs, parts = fp8_layout(spec.shape, n_in, n_out, block, path[-1] in FP8_PARTS_LEAVES)
    w = Fp8Weight(jax.ShapeDtypeStruct(q, jnp.float8_e4m3fn), jax.ShapeDtypeStruct(s, jnp.float32), tuple(block),
                  ins, outs, parts)
    sh = packed_sharding(w, sharding, spec.axes, ".".join(str(k) for k in path))
    return dataclasses.replace(w, q=jax.ShapeDtypeStruct(q, jnp.float8_e4m3fn, sharding=sh.q),
                               scale=jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh.scale))


def read_fp8_rule(rule: TensorRule, tensors: dict[str, TensorInfo], block: tuple[int, int]
                  ) -> tuple[np.ndarray, np.ndarray, tuple]:
    """(q, scale, index into the Fp8Weight's q and scale) for `rule`'s tensor: the checkpoint's own e4m3
    tensor and weight_scale_inv, or a float tensor quantized to `block`s here (HF's [out, in] either way;
    a fused [E, 2I, D] gate_up_proj as [E, 2, I, D] so gate and up keep blocks of their own)."""
    info = tensors[rule.hf_name]
    index = tuple(i for i in rule.index if not isinstance(i, slice))  # gate / up: their part of [.., 2, I, D]
    w = load_tensor(info)
    if info.dtype in FP8_DTYPES:
        return w, load_tensor(tensors[rule.hf_name + "_scale_inv"]).astype(np.float32), index
    w = np.asarray(w, np.float32)
    if w.ndim == 3 and rule.hf_name.endswith("gate_up_proj"):
        w = w.reshape(w.shape[0], 2, w.shape[1] // 2, w.shape[2])
    q, scale = fp8_quantize_blocks(w, block)
    return q, scale, index


def fused_moe_layers(tensors: dict[str, TensorInfo]) -> frozenset[int]:
    pat = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj$")
    return frozenset(int(m.group(1)) for n in tensors if (m := pat.match(n)))


def effective_config(cfg: ModelConfig, tensors: dict[str, TensorInfo]) -> ModelConfig:
    """MTP layers are kept only when the checkpoint has them (HF's save_pretrained drops them)."""
    if cfg.num_nextn_predict_layers:
        first = f"model.layers.{cfg.num_hidden_layers}."
        if not any(n.startswith(first) for n in tensors):
            log.info("config names %d MTP layer(s) but the checkpoint has none; loading without MTP",
                     cfg.num_nextn_predict_layers)
            return dataclasses.replace(cfg, num_nextn_predict_layers=0)
    return cfg


def _get(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: Any, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def _update(leaf: jax.Array, value: jax.Array, starts: tuple) -> jax.Array:
    return jax.lax.dynamic_update_slice(leaf, value.astype(leaf.dtype), starts)


_update_donated = jax.jit(_update, donate_argnums=0)


def _write(leaf: jax.Array, index: tuple, value: np.ndarray) -> jax.Array:
    """leaf[index] = value, in place (donated). index: ints then slices/ints (gate/up half; a slice with bounds:
    the first rows of a vocab padded for tensor parallelism)."""
    full = [slice(None)] * leaf.ndim
    for i, ix in enumerate(index):
        full[i] = ix
    starts, shape = [], []
    for ix, dim in zip(full, leaf.shape):
        if isinstance(ix, slice):
            start, stop, _ = ix.indices(dim)
            starts.append(start)
            shape.append(stop - start)
        else:
            starts.append(ix)
            shape.append(1)
    value = np.asarray(value).reshape(shape)
    return _update_donated(leaf, jnp.asarray(value), tuple(np.int32(s) for s in starts))


# Models of at most this many bytes, on CPU devices, are assembled in numpy (`host_assembly`).
HOST_ASSEMBLY_BYTES = 1 << 30


def host_assembly(abstract: Any) -> bool:
    """Whether the load assembles the leaves in host memory (numpy) and puts each on the device once, instead of
    updating device leaves in place: on CPU devices of this process (one, or a mesh of them: each leaf then put
    split as its sharding says), for models of at most HOST_ASSEMBLY_BYTES. The in-place updates compile a program
    for each shape of tensor, leaf and sharding: on an empty compilation cache the embedded demo model's load took
    2.9 s alone and 11-21 s beside warm-up's compiles (a busy 2-core machine), against 0.1 s for the numpy writes;
    on a CPU the second copy of a small model costs nothing that matters."""
    leaves = jax.tree.leaves(abstract)
    cpus = set(jax.devices("cpu"))
    return (all(x.sharding.device_set <= cpus and x.sharding.is_fully_addressable for x in leaves)
            and sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves) <= HOST_ASSEMBLY_BYTES)


def _write_host(leaf: np.ndarray, index: tuple, value: np.ndarray) -> None:
    """leaf[index] = value, cast to the leaf's dtype (as `_write`, on a numpy leaf)."""
    region = tuple(index) + (slice(None),) * (leaf.ndim - len(index))
    leaf[region] = np.asarray(value).reshape(leaf[region].shape)


def load_hf_checkpoint(
    model_dir: str,
    cfg: ModelConfig,
    dtype: Any = jnp.bfloat16,
    shardings: Any = None,
    progress: bool = True,
    hf_config: dict | None = None,
    quantization: str | None = None,
) -> tuple[ModelConfig, dict]:
    """Returns (config actually loaded, params). `shardings`: optional pytree of jax.sharding.Sharding
    matching the params, so each leaf is created straight on its devices. `quantization`: see the module doc."""
    cfg, pending = prepare_hf_checkpoint(model_dir, cfg, dtype, shardings, progress, hf_config, quantization)
    return cfg, pending.result()


def prepare_hf_checkpoint(
    model_dir: str,
    cfg: ModelConfig,
    dtype: Any = jnp.bfloat16,
    shardings: Any = None,
    progress: bool = True,
    hf_config: dict | None = None,
    quantization: str | None = None,
) -> tuple[ModelConfig, PendingParams]:
    """(config actually loaded, the params pending): the checkpoint's index read and every tensor checked now
    (a CheckpointError before any device work), the tensors read when the load starts."""
    tensors = index_checkpoint(model_dir)
    cfg = effective_config(cfg, tensors)
    rules = expected_tensors(cfg, fused_moe_layers(tensors))
    specs = param_specs(cfg)
    fp8_block = fp8_block_shape(hf_config)

    check_tensors(rules, tensors, fp8_block)  # fail fast, naming the first bad tensor, before any device work
    fp8_paths, online = fp8_leaf_paths(rules, tensors, quantization)
    block = FP8_BLOCK if online else fp8_block
    known = {r.hf_name for r in rules} | {r.hf_name + "_scale_inv" for r in rules}
    unused = [n for n in tensors if n not in known and not is_ignored(cfg, n)]
    if unused:
        log.warning("ignoring %d checkpoint tensors the model does not use, e.g. %s", len(unused), unused[:3])

    abstract = abstract_from_specs(cfg, dtype, shardings)
    for path in (p for p in _spec_paths(specs) if p in fp8_paths):  # in tree order: the first bad split is refused
        _set(abstract, path, fp8_abstract(path, _get(specs, path), block, _get(abstract, path).sharding))
    on_host = host_assembly(abstract)

    def load_to(target: Any) -> dict:
        """The params placed as `target` says (`abstract`, or it with leaves in host memory: those are assembled in
        numpy and put there once, never on the device; PendingParams.load_to)."""
        host = {keys for keys in fp8_paths | set(_spec_paths(specs))
                if on_host or in_host_memory(_get(target, keys))}

        def alloc(path, spec: ParamSpec):
            keys = tuple(_key(k) for k in path)
            if keys in fp8_paths:
                a = _get(target, keys)
                if keys in host:
                    return dataclasses.replace(a, q=np.zeros(a.q.shape, a.q.dtype),
                                               scale=np.zeros(a.scale.shape, np.float32))
                return dataclasses.replace(a, q=jnp.zeros(a.q.shape, a.q.dtype, device=a.q.sharding),
                                           scale=jnp.zeros(a.scale.shape, jnp.float32, device=a.scale.sharding))
            if keys in host:
                return np.zeros(spec.shape, spec_dtype(spec, dtype))
            sh = None if shardings is None else _get(shardings, keys)
            return jnp.zeros(spec.shape, spec_dtype(spec, dtype), device=sh)

        params = jax.tree_util.tree_map_with_path(alloc, specs, is_leaf=is_spec)
        it = rules
        if progress:
            from tqdm import tqdm

            it = tqdm(rules, desc="loading weights", unit="tensor", leave=False, disable=None)
        for rule in it:
            if rule.path in fp8_paths:
                q, scale, index = read_fp8_rule(rule, tensors, block)
                leaf = _get(params, rule.path)
                if rule.path in host:
                    _write_host(leaf.q, index, q)
                    _write_host(leaf.scale, index, scale)
                else:
                    _set(params, rule.path, dataclasses.replace(leaf, q=_write(leaf.q, index, q),
                                                                scale=_write(leaf.scale, index, scale)))
                continue
            value = read_rule_tensor(rule, tensors, fp8_block)
            if rule.path in host:
                _write_host(_get(params, rule.path), rule.index, value)
            else:
                _set(params, rule.path, _write(_get(params, rule.path), rule.index, value))
        for keys in host:  # one leaf at a time: its numpy copy goes as it is placed
            _set(params, keys, jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), _get(params, keys),
                                            _get(target, keys)))
        return params

    return cfg, PendingParams(abstract, load_to=load_to)


def _spec_paths(specs: Any) -> list[tuple]:
    """The paths of the param specs' leaves, in tree order."""
    return [tuple(_key(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]]


def _key(k) -> Any:
    """A tree path entry (DictKey / SequenceKey) back to the plain key."""
    return getattr(k, "key", getattr(k, "idx", k))
