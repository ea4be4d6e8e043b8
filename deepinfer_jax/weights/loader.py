"""One entry point for the engine: a model directory (HF safetensors or converted orbax) -> params.

A directory holding `deepinfer_checkpoint.json` is a converted checkpoint (weights/orbax_io.py): its
arrays are restored straight onto their shardings, quantized leaves as `QuantizedWeight`. Anything
else is read as a Hugging Face directory (weights/hf_loader.py). Either way the bytes the weights
take on device are logged.

`quantization` is vLLM's `--quantization`: None ("auto") takes the checkpoint's own format. A Hugging Face
directory also takes "none" (an FP8 checkpoint dequantized at load) and "fp8" (kept as FP8, or a float
checkpoint quantized online to 128 x 128 blocks); INT8 / INT4 come from `deepinfer convert --quantize`. A
converted directory takes only the method it was converted with.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.quant import weights_nbytes
from deepinfer_jax.weights.hf_loader import prepare_hf_checkpoint
from deepinfer_jax.weights.orbax_io import is_converted, prepare_converted
from deepinfer_jax.weights.pending import PendingParams

log = logging.getLogger(__name__)

__all__ = ["load_model", "prepare_model", "is_converted", "weights_nbytes"]


QUANTIZATIONS = ("auto", "none", "fp8", "int8", "int4")


def check_quantization(model_dir: str, quantization: str | None) -> None:
    """A ValueError unless `quantization` can be served from `model_dir` (see the module doc)."""
    q = quantization or "auto"
    if q in ("fp4", "mxfp4", "nvfp4"):
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {q!r}: online FP4 quantization is not "
                         "implemented (vLLM's online MXFP4 is 'mxfp4'); FP4 weights are served as a checkpoint stores "
                         "them: DeepSeek-V4's released FP4 experts load with 'auto'")
    if q not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if q == "auto":
        return
    if is_converted(model_dir):
        with open(os.path.join(model_dir, "deepinfer_checkpoint.json")) as f:
            method = json.load(f)["quantization"]["method"]
        if q != method:
            raise ValueError(f"quantization {q!r} does not match the converted checkpoint {model_dir}, converted with "
                             f"--quantize {method} (convert the Hugging Face directory again, or serve that one)")
    elif q in ("int8", "int4"):
        raise ValueError(f"quantization {q!r} needs a converted checkpoint: deepinfer convert --src {model_dir} "
                         f"--dst DIR --quantize {q}")


def load_model(model_dir: str, dtype: Any = jnp.bfloat16, shardings: Any = None, progress: bool = True,
               quantization: str | None = None, vocab_multiple: int = 1) -> tuple[ModelConfig, dict]:
    """Returns (ModelConfig, params) with every leaf on its device (or `shardings`, a params-shaped tree
    of jax.sharding.Sharding; at a quantized leaf either the float leaf's sharding or a
    QuantizedWeight of shardings for q and scale). `vocab_multiple`: embed / lm_head padded to a multiple of it
    where it does not divide vocab_size (ModelSharding.vocab_multiple; the shardings are then the padded
    config's). An "mtp" subtree of `shardings` is dropped when the checkpoint has no MTP weights."""
    cfg, pending = prepare_model(model_dir, dtype, shardings, progress, quantization, vocab_multiple)
    return cfg, pending.result()


def prepare_model(model_dir: str, dtype: Any = jnp.bfloat16, shardings: Any = None, progress: bool = True,
                  quantization: str | None = None, vocab_multiple: int = 1) -> tuple[ModelConfig, PendingParams]:
    """`load_model` with the params pending (weights/pending.py): the directory is read and checked now (a
    CheckpointError before any device work), the arrays load once the engine starts the load."""
    check_quantization(model_dir, quantization)
    if is_converted(model_dir):
        vocab = ModelConfig.from_model_dir(model_dir).vocab_size
        if vocab % vocab_multiple:
            raise ValueError(f"vocab_size = {vocab} of the converted checkpoint {model_dir} is not divisible by "
                             f"the tensor parallel size, and a converted checkpoint's vocab is not padded; serve "
                             f"its HF directory (padded at load) or change --tensor-parallel-size")
        cfg, pending = prepare_converted(model_dir, dtype, shardings=shardings, progress=progress)
        kind = "converted"
    elif ModelConfig.from_model_dir(model_dir).family == "deepseek_v4":
        cfg, pending = _prepare_v4(model_dir, dtype, shardings, quantization, vocab_multiple)
        kind = "HF"
    else:
        cfg = ModelConfig.from_model_dir(model_dir).with_vocab_multiple(vocab_multiple)
        with open(os.path.join(model_dir, "config.json")) as f:
            hf_config = json.load(f)
        cfg, pending = prepare_hf_checkpoint(model_dir, cfg, dtype, shardings=shardings, progress=progress,
                                             hf_config=hf_config, quantization=quantization)
        kind = "HF"
    load, load_to = pending.load, pending.load_to

    def logged(params: Any) -> Any:
        log.info("loaded %s checkpoint %s: weights take %.3f GiB", kind, model_dir, weights_nbytes(params) / 2**30)
        return params

    return cfg, PendingParams(pending.abstract, lambda: logged(load()),
                              None if load_to is None else (lambda abstract: logged(load_to(abstract))))


def check_v4_quantization(quantization: str | None) -> None:
    """DeepSeek-V4 takes "auto" (a released FP8 / FP4 checkpoint in its formats) and "none" (dequantized)."""
    if quantization not in (None, "auto", "none"):
        raise ValueError(f"quantization {quantization!r} is not supported for deepseek_v4: a released FP8 / FP4 "
                         "checkpoint is served in its formats ('auto') or dequantized ('none'); online quantization "
                         "of a V4 float checkpoint is not implemented")


def _prepare_v4(model_dir: str, dtype: Any, shardings: Any, quantization: str | None,
                vocab_multiple: int) -> tuple[ModelConfig, PendingParams]:
    """A DeepSeek-V4 HF directory (weights/name_table_v4.py): bf16 / fp32 weights, or the released FP8 /
    FP4 ones kept in their formats ("auto") or dequantized ("none"). The names, shapes and dtypes of every tensor
    are checked now, from the headers."""
    from deepinfer_jax.weights.name_table_v4 import load_v4_checkpoint, v4_abstract, v4_checkpoint_config
    from deepinfer_jax.weights.pending import abstract_from_specs

    if vocab_multiple != 1:
        raise ValueError("deepseek_v4's layout keeps the vocab whole (sharding/rules.py v4_rules): no vocab padding")
    check_v4_quantization(quantization)
    cfg = v4_checkpoint_config(ModelConfig.from_model_dir(model_dir), model_dir)  # MTP only where the files have it
    abstract = v4_abstract(model_dir, cfg.v4, abstract_from_specs(cfg, dtype, shardings), quantization)

    def load_to(target: Any) -> Any:
        """Assembled in host memory (numpy), then each leaf put once on its placement in `target`: its device (a
        mesh's: each device given its slice, a kept FP4 / FP8 leaf's q and scale as sharding/packed.py splits them),
        or host memory for a leaf chosen by --cpu-offload-gb (runner/weight_offload.py), never on the device."""
        import jax

        host = load_v4_checkpoint(model_dir, dtype, cfg.v4, on_host=True, quantization=quantization)[1]
        return jax.device_put(host, jax.tree.map(lambda a: a.sharding, target))

    return cfg, PendingParams(abstract, load_to=load_to)
