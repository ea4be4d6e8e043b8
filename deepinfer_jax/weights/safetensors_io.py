"""Zero-copy reading of safetensors files into numpy, for every dtype DeepSeek checkpoints use.

The `safetensors` package's numpy backend cannot represent bfloat16 or float8_e4m3fn, and its flax
backend places arrays on a device; the loader needs host numpy views (memory-mapped, one tensor at a
time), so this module reads the format directly: 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}}, then the raw bytes. Dtypes come from numpy and ml_dtypes.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),  # DeepSeek-V4's power-of-two scales
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    path: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    stop: int


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse one file's header; raises CheckpointError when the file is not a safetensors file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000 or n > os.path.getsize(path):
                raise CheckpointError(f"{path} is not a safetensors file (bad header length)")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a safetensors file ({e})") from None
    base = 8 + n
    out = {}
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file (its header is not a JSON object)")
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            s, e = meta["data_offsets"]
            out[name] = TensorInfo(name, path, meta["dtype"], tuple(meta["shape"]), base + s, base + e)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path} is not a safetensors file (bad header entry for {name})") from None
    size = os.path.getsize(path)
    end = max((t.stop for t in out.values()), default=base)
    if end > size:  # found here, before any tensor is memory-mapped past the end of the file
        raise CheckpointError(f"{path} is truncated: its header needs {end} bytes, the file has {size} "
                              "(an interrupted download or copy?)")
    return out


def load_tensor(info: TensorInfo) -> np.ndarray:
    """A read-only memory-mapped numpy view of one tensor (no copy until used)."""
    if info.dtype not in DTYPES:
        raise CheckpointError(f"tensor {info.name} has unsupported dtype {info.dtype}")
    dt = DTYPES[info.dtype]
    count = int(np.prod(info.shape)) if info.shape else 1
    if count * dt.itemsize != info.stop - info.start:
        raise CheckpointError(f"tensor {info.name} in {info.path}: byte size does not match its shape")
    arr = np.memmap(info.path, dtype=dt, mode="r", offset=info.start, shape=(count,))
    return arr.reshape(info.shape)


def has_weight_files(model_dir: str) -> bool:
    """Whether `model_dir` holds any weights yet (a safetensors index or file): `deepinfer plan` plans a directory
    of config.json alone from the config."""
    return os.path.isfile(os.path.join(model_dir, "model.safetensors.index.json")) or any(
        f.endswith(".safetensors") for f in os.listdir(model_dir))


def index_checkpoint(model_dir: str) -> dict[str, TensorInfo]:
    """All tensors of an HF directory: `model.safetensors`, or the shards named by
    `model.safetensors.index.json`, or else every `*.safetensors` file in it."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
    else:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} holds no *.safetensors files")
    tensors: dict[str, TensorInfo] = {}
    for fn in files:
        path = os.path.join(model_dir, fn)
        if not os.path.isfile(path):
            raise CheckpointError(f"shard {fn} named in the index is missing from {model_dir}")
        tensors.update(read_header(path))
    return tensors
