"""HF safetensors -> converted orbax checkpoint (see weights/orbax_io.py for the format).

    python tools/convert_weights.py --src HF_DIR --dst OUT_DIR [--dtype bfloat16|float32]
        [--quantize none|int8|int4] [--group-size 128] [--overwrite]

Invariants:
- Everything is checked before anything is written: the config parses, every tensor the name table
  expects is present with its shape and a float (or FP8 + weight_scale_inv) dtype, and `--dst` is free
  (or `--overwrite`). Bad input gets one error line and exit status 1 (a usage error found while parsing,
  such as a --src without config.json, exit status 2); no directory is created.
- Tensors are read one at a time (memory-mapped), transformed by the name table (`read_rule_tensor`),
  and assembled into one *unit* (one decoder layer, the embeddings/head, or one MTP module) at a time;
  each unit is checked against the param specs, quantized leaf by leaf, and written with one orbax
  partial save. Peak host memory is about two copies of the largest unit (fp32 while quantizing),
  never a stacked [L, ...] leaf nor the whole model.
- An FP8 block-scaled source is dequantized (`--quantize none`, vLLM's meaning) or requantized to INT8 /
  INT4: the converted format holds no FP8 leaves. An FP8 checkpoint is served as FP8 straight from its
  Hugging Face directory (weights/hf_loader.py), which reads no more than a conversion would.
- Output goes to a temporary directory beside `--dst` and is renamed onto it only after the metadata
  file, written last, is in place; any failure (or Ctrl-C) removes the temporary directory. An
  existing `--dst` is replaced only after the new one is complete.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import uuid
from typing import Callable, Sequence

import jax
import ml_dtypes
import numpy as np

from deepinfer_jax.config import ConfigError, ModelConfig
from deepinfer_jax.models.quant import METHODS, is_quantized, quant_layout, quantize
from deepinfer_jax.weights import orbax_io
from deepinfer_jax.weights.hf_loader import (
    FP8_DTYPES, check_tensors, effective_config, fp8_block_shape, fused_moe_layers, read_rule_tensor,
)
from deepinfer_jax.weights.name_table import TensorRule, expected_tensors, is_ignored
from deepinfer_jax.weights.safetensors_io import CheckpointError, index_checkpoint

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json", "added_tokens.json")


class ConversionError(ValueError):
    """Bad converter input (arguments or destination); the message says what to change."""


def _validate_args(src: str, dst: str, dtype: str, quantize: str, group_size: int, overwrite: bool) -> None:
    if dtype not in DTYPES:
        raise ConversionError(f"unsupported --dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if quantize == "fp8":
        raise ConversionError("--quantize fp8: the converted format holds no FP8 weights; serve the Hugging Face "
                              "directory itself (an FP8 checkpoint loads as FP8, a float one with --quantization fp8)")
    if quantize not in METHODS:
        raise ConversionError(f"unsupported --quantize {quantize!r}; expected one of {sorted(METHODS)}")
    if group_size < 1:
        raise ConversionError(f"--group-size must be positive, got {group_size}")
    if not os.path.isdir(src):
        raise ConversionError(f"--src {src} is not a directory")
    if os.path.realpath(src) == os.path.realpath(dst):
        raise ConversionError("--dst must differ from --src")
    if os.path.lexists(dst) and not overwrite:
        raise ConversionError(f"--dst {dst} already exists; pass --overwrite to replace it")


def _read_hf_config(src: str) -> dict:
    path = os.path.join(src, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{src} is not a Hugging Face checkpoint: it has no config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None


def _assign(buf: np.ndarray, index: tuple, value: np.ndarray) -> int:
    """buf[index] = value (index: ints, then slices / ints, as the name table writes it) -> elements set."""
    target = buf[index] if index else buf
    if target.shape != value.shape:
        raise CheckpointError(f"a tensor of shape {value.shape} does not fit its slot of shape {target.shape}")
    if index:
        buf[index] = value
    else:
        buf[...] = value
    return int(value.size)


def _build_unit(unit: orbax_io.Unit, expected: dict, rules: list[tuple[TensorRule, tuple, tuple]],
                read: Callable[[TensorRule], np.ndarray], on_tensor: Callable[[], None]) -> dict:
    """Assemble one unit from its rules and quantize it; every leaf is checked against `expected`."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(expected, is_leaf=is_quantized)
    keys = [orbax_io.path_keys(p) for p, _ in flat]
    bufs: dict[tuple, np.ndarray] = {}
    for k, (_, sds) in zip(keys, flat):
        shape = orbax_io.get_path(unit.specs, k).shape  # the float leaf of the param specs, unstacked
        if not is_quantized(sds) and tuple(sds.shape) != tuple(shape):
            raise CheckpointError(f"{unit.name}{list(k)}: stored shape {sds.shape} differs from the specs {shape}")
        # Quantized leaves are staged in fp32 so they are quantized from the source precision.
        bufs[k] = np.empty(shape, np.float32 if is_quantized(sds) else sds.dtype)
    filled = {k: 0 for k in keys}
    for rule, path, index in rules:
        if path not in bufs:
            raise CheckpointError(f"tensor {rule.hf_name} maps to {unit.name}{list(path)}, not a param leaf")
        filled[path] += _assign(bufs[path], index, np.asarray(read(rule), dtype=bufs[path].dtype))
        on_tensor()
    leaves = []
    for k, (_, sds) in zip(keys, flat):
        buf = bufs.pop(k)
        if filled[k] != buf.size:
            raise CheckpointError(f"{unit.name}{list(k)}: the checkpoint filled {filled[k]} of {buf.size} values")
        if is_quantized(sds):
            n_in, n_out = quant_layout(k)
            qw = quantize(buf, sds.bits, n_in, n_out, sds.group_size or 1)
            del buf
            if (qw.q.shape, qw.scale.shape, qw.group_size) != (sds.q.shape, sds.scale.shape, sds.group_size):
                raise CheckpointError(f"{unit.name}{list(k)}: quantized shapes do not match the param specs")
            leaves.append(qw)
        else:
            leaves.append(buf)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def convert(src: str, dst: str, dtype: str = "bfloat16", quantize: str = "none", group_size: int = 128,
            overwrite: bool = False, progress: bool = True) -> dict:
    """Convert HF directory `src` into a converted directory `dst`; returns the metadata written."""
    _validate_args(src, dst, dtype, quantize, group_size, overwrite)
    hf_config = _read_hf_config(src)
    cfg = ModelConfig.from_hf_dict(hf_config)
    if cfg.family == "deepseek_v4":
        return _convert_v4(src, dst, cfg, hf_config, dtype, quantize)
    tensors = index_checkpoint(src)
    cfg = effective_config(cfg, tensors)
    fused = fused_moe_layers(tensors)
    rules = expected_tensors(cfg, fused)
    fp8_block = fp8_block_shape(hf_config)
    check_tensors(rules, tensors, fp8_block)
    known = {r.hf_name for r in rules} | {r.hf_name + "_scale_inv" for r in rules}
    unused = [n for n in tensors if n not in known and not is_ignored(cfg, n)]
    if unused:
        log.warning("ignoring %d checkpoint tensors the model does not use, e.g. %s", len(unused), unused[:3])

    units = orbax_io.checkpoint_units(cfg)
    by_unit: dict[str, list] = {u.name: [] for u in units}
    for rule in rules:
        name, path, index = orbax_io.unit_name_of(cfg, rule.path, rule.index)
        by_unit[name].append((rule, path, index))

    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(dst))}.converting-{uuid.uuid4().hex[:8]}")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(rules), desc="converting", unit="tensor", disable=None)
    try:
        os.makedirs(tmp)
        writer = orbax_io.UnitWriter(tmp)
        nbytes = 0
        for u in units:
            expected = orbax_io.expected_unit(u, DTYPES[dtype], quantize, group_size)
            tree = _build_unit(u, expected, by_unit[u.name], lambda r: read_rule_tensor(r, tensors, fp8_block),
                               (lambda: bar.update(1)) if bar else (lambda: None))
            nbytes += sum(x.nbytes for x in jax.tree.leaves(tree))
            writer.save(u.name, tree)
            del tree
        writer.finalize()
        meta = _write_metadata(tmp, src, cfg, hf_config, dtype, quantize, group_size, units, fused, nbytes,
                               any(i.dtype in FP8_DTYPES for i in tensors.values()))
        _replace(tmp, dst)
        tmp = None
        return meta
    finally:
        if bar is not None:
            bar.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _convert_v4(src: str, dst: str, cfg: ModelConfig, hf_config: dict, dtype: str, quantize: str) -> dict:
    """DeepSeek-V4: the checkpoint read and checked by its name table (weights/name_table_v4.py), on the host, in
    `dtype`, then written unit by unit (orbax_io: "top" and one unit per layer). Float weights only: a released
    FP8 / FP4 checkpoint is dequantized (served in its own formats from the HF directory instead)."""
    from deepinfer_jax.weights.name_table_v4 import load_v4_checkpoint, v4_checkpoint_config

    cfg = v4_checkpoint_config(cfg, src)  # its MTP layers where the files have them (unit "mtp_J")
    if quantize != "none":
        raise ValueError(f"--quantize {quantize} is not supported for deepseek_v4 (float conversions only; serve "
                         f"the HF directory {src} to keep a released checkpoint's FP8 / FP4 weights)")
    _, host = load_v4_checkpoint(src, DTYPES[dtype], cfg.v4, on_host=True, quantization="none")
    units = orbax_io.checkpoint_units(cfg)
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(dst))}.converting-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(tmp)
        writer = orbax_io.UnitWriter(tmp)
        nbytes = 0
        for u in units:
            tree = ({k: host[k] for k in u.specs} if not u.path else host[u.path[0]][u.path[1]])
            nbytes += sum(x.nbytes for x in jax.tree.leaves(tree))
            writer.save(u.name, tree)
        writer.finalize()
        meta = _write_metadata(tmp, src, cfg, hf_config, dtype, "none", 0, units, frozenset(), nbytes,
                               bool(hf_config.get("quantization_config")))
        _replace(tmp, dst)
        tmp = None
        return meta
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_metadata(tmp: str, src: str, cfg: ModelConfig, hf_config: dict, dtype: str, method: str,
                    group_size: int, units: list, fused: frozenset, nbytes: int, fp8: bool) -> dict:
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    for fn in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, fn)):
            shutil.copy2(os.path.join(src, fn), os.path.join(tmp, fn))
    meta = {
        "format": orbax_io.FORMAT,
        "converter_version": orbax_io.CONVERTER_VERSION,
        "dtype": dtype,
        "quantization": {"method": method, "group_size": group_size if method == "int4" else 0,
                         "scale_dtype": "float32"},
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "units": [u.name for u in units],
        "weights_nbytes": int(nbytes),
        "source": {"path": os.path.abspath(src), "fp8": fp8, "fused_moe_layers": sorted(fused)},
        "model_config": cfg.to_dict(),
    }
    with open(os.path.join(tmp, orbax_io.META_FILE), "w") as f:  # last: marks the directory complete
        json.dump(meta, f, indent=2)
    return meta


def _replace(tmp: str, dst: str) -> None:
    """Rename the finished `tmp` onto `dst`; an old `dst` is moved aside first and removed after."""
    old = None
    if os.path.lexists(dst):
        old = f"{tmp}.old"
        os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        if old is not None:
            os.rename(old, dst)  # put the previous checkpoint back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line, `deepinfer convert: error: ...`, exit status 2 (as server/args.py ArgParser)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _src_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} " + ("is not a directory" if os.path.exists(text)
                                                         else "does not exist"))
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a model directory (no config.json)")
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="deepinfer convert", description="Convert an HF DeepSeek checkpoint "
                "(bf16 / fp32 / FP8 safetensors) into the engine's orbax format.")
    p.add_argument("--src", required=True, type=_src_dir, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--dst", required=True, help="output directory (must not exist unless --overwrite)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype of float weights")
    p.add_argument("--quantize", default="none", choices=sorted(METHODS) + ["fp8"],
                   help="weight-only quantization of the linear layers and experts")
    p.add_argument("--group-size", type=_positive_int, default=128, help="INT4 group length along the input dim")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --dst")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none either where stderr is not "
                                                              "a terminal)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (also `deepinfer convert`). 0 on success, 1 on bad input, 2 on bad usage."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)  # as serve's: JAX's INFO lines (its TPU probe) are noise here
    try:
        meta = convert(args.src, args.dst, args.dtype, args.quantize, args.group_size, args.overwrite,
                       progress=not args.no_progress and sys.stderr.isatty())
    except (ValueError, OSError) as e:  # ConfigError, CheckpointError, ConversionError are ValueErrors
        print(f"deepinfer convert: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("deepinfer convert: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(f"wrote {args.dst} ({meta['quantization']['method']}, {meta['dtype']}, "
          f"{meta['weights_nbytes'] / 2**30:.3f} GiB of weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
