"""`deepinfer plan` against what the loader actually allocates: FP8 kept, float, on one device and split over a
mesh of fake CPU devices; and its verdict on a device too small."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from hf_models import fp8_checkpoint
from deepinfer_jax.cli import main
from deepinfer_jax.engine.plan import plan
from deepinfer_jax.models.quant import weights_nbytes
from deepinfer_jax.weights.loader import load_model


@pytest.fixture(scope="module")
def dirs(hf_case, tmp_path_factory):
    _, path = hf_case("v3_grouped_noaux")
    d, _ = fp8_checkpoint(path, str(tmp_path_factory.mktemp("plan") / "fp8"), (16, 24))
    return path, d


def test_plan_equals_allocated_bytes_on_one_device(dirs):
    path, d = dirs
    for model, kw, dtype in ((d, {}, jnp.float32), (d, {"quantization": "none"}, jnp.float32),
                             (path, {"quantization": "fp8"}, jnp.float32), (path, {}, jnp.bfloat16)):
        _, params = load_model(model, dtype, progress=False, **kw)
        p = plan(model, dtype=jnp.dtype(dtype).name, **kw)
        assert p.weight_bytes_per_device == weights_nbytes(params), (model, kw)
    assert plan(d, dtype="float32").weights == "fp8 (kept)"


SHARDED = """
import json, sys
import jax, jax.numpy as jnp
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.engine.plan import plan
from deepinfer_jax.sharding import ParallelConfig, build_sharding
from deepinfer_jax.weights.loader import load_model
model, tp, dp, ep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
cfg = ModelConfig.from_model_dir(model)
sh = build_sharding(cfg, ParallelConfig(tp, dp, ep)).param_shardings(cfg)
_, params = load_model(model, jnp.float32, shardings=sh, progress=False)
per_dev = {}
for leaf in jax.tree.leaves(params):
    for s in leaf.addressable_shards:
        per_dev[s.device.id] = per_dev.get(s.device.id, 0) + s.data.nbytes
p = plan(model, dtype="float32", tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep)
print(json.dumps([max(per_dev.values()), p.weight_bytes_per_device]))
"""


def test_plan_equals_allocated_bytes_on_a_mesh(dirs):
    """On 4 fake CPU devices (DP 4 with expert parallelism: the FP8 experts' q and scales split over the expert axis)
    the largest per-device sum of the loaded params' shards is the plan's figure. (Its 16 x 24 blocks do not survive
    TP = 2, whose refusal and whose bytes with blocks that do are in tests/sharding/test_fp8_sharded.py.)"""
    tp, dp, ep = 1, 4, True
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", SHARDED, dirs[1], str(tp), str(dp), str(int(ep))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    allocated, planned = json.loads(out.stdout.strip().splitlines()[-1])
    assert allocated == planned


def test_plan_verdicts(dirs, capsys):
    _, d = dirs
    assert main(["plan", "--model", d, "--gpu-memory", "1", "--dtype", "float32"]) == 0
    text = capsys.readouterr().out
    assert "weights per device" in text and "fits" in text and "does not fit" not in text
    p = plan(d, dtype="float32", gpu_memory_gib=1.0, kv_cache_dtype="fp8")
    assert p.kv_bytes_per_token * 2 == plan(d, dtype="bfloat16").kv_bytes_per_token
    # Too little memory for the weights, then for one max_model_len of KV.
    assert main(["plan", "--model", d, "--gpu-memory", "0.0001", "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["fits"] is False and got["reason"].startswith("the weights take")
    small = plan(d, dtype="float32", gpu_memory_gib=0.0007, max_model_len=512)
    assert small.fits is False and "fewer than max_model_len 512" in small.reason, small
    assert main(["plan", "--model", d, "-q", "int8"]) == 2
    assert "needs a converted checkpoint" in capsys.readouterr().err


def test_serve_and_llm_refuse_what_cannot_fit_before_loading(dirs, capsys, monkeypatch):
    """`serve --gpu-memory` refuses at parse time, LLM(gpu_memory=...) before reading any weight, both with the
    plan's reason."""
    from deepinfer_jax import LLM
    from deepinfer_jax.cli import _serve_parser
    from deepinfer_jax.server.args import check_engine_args, parse_with_config
    from deepinfer_jax.weights import loader

    _, d = dirs
    reason = plan(d, dtype="bfloat16", gpu_memory_gib=0.0005, max_model_len=512).reason
    assert reason.startswith("the KV cache has room for")
    parser = _serve_parser()
    with pytest.raises(SystemExit) as e:
        check_engine_args(parser, parse_with_config(parser, ["--model", d, "--gpu-memory", "0.0005",
                                                             "--max-model-len", "512"]))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == f"deepinfer serve: error: {d} does not fit: {reason}"

    def no_load(*a, **k):
        raise AssertionError("weights read for a model that cannot fit")

    monkeypatch.setattr(loader, "prepare_model", no_load)
    with pytest.raises(ValueError) as e:
        LLM(d, gpu_memory=0.0005, max_model_len=512, skip_tokenizer_init=True, progress=False)
    assert str(e.value) == f"{d} does not fit: {reason}"


def test_plan_from_config_alone(dirs, tmp_path, capsys):
    """A directory of config.json only (no weights yet) plans within 1% of the same checkpoint with its weights,
    FP8 (its quantization_config) and float, and says where its figures come from."""
    import shutil

    for model in dirs:
        bare = tmp_path / os.path.basename(model)
        bare.mkdir()
        shutil.copy(os.path.join(model, "config.json"), bare / "config.json")
        for kw in ({}, {"quantization": "none"}, {"quantization": "fp8"}):
            want, got = plan(model, **kw), plan(str(bare), **kw)
            assert (got.weights, got.dtype, got.kv_bytes_per_token) == (want.weights, want.dtype, want.kv_bytes_per_token)
            assert abs(got.weight_bytes_per_device - want.weight_bytes_per_device) <= 0.01 * want.weight_bytes_per_device
            assert got.from_config_only and not want.from_config_only
    assert main(["plan", "--model", str(bare)]) == 0
    assert "these figures come from config.json alone" in capsys.readouterr().out
