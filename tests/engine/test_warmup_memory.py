"""A warm-up step that runs out of device memory is reported with what it needed and what held the memory
(runner/warmup.py `out_of_memory_message`): the figures come from the compiled programs and the runner's arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config import RunnerConfig
from deepinfer_jax.runner.inputs import Shapes
from deepinfer_jax.runner.model_runner import ModelRunner
from deepinfer_jax.runner.step_io import packed
from deepinfer_jax.runner.warmup import out_of_memory_message
from deepinfer_jax.weights.loader import load_model


def test_out_of_memory_message_names_the_step_its_temporaries_and_the_settings(hf_case):
    _, path = hf_case("v3_grouped_noaux")
    cfg, params = load_model(path, jnp.float32, progress=False)
    rc = RunnerConfig(dtype="float32", attn_impl="reference", moe_impl="ragged", warmup_full_variant=False)
    runner = ModelRunner(cfg, params, rc, Shapes((16, 64), 4, 8, 8, 64), 40)
    runner.warmup(progress=False)
    host = runner.padding_step(64, False)
    msg = out_of_memory_message(runner, host)

    temps = [runner.programs.executables[p].memory_analysis().temp_size_in_bytes
             for p in runner.programs.programs_of(packed(host)[0])]
    weights = sum(a.nbytes for a in jax.tree.leaves(runner.params))
    cache = sum(a.nbytes for a in jax.tree.leaves(runner.kv_cache))
    size = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731 - the tiny model's sizes are below a GiB
    assert min(temps) > 0
    assert msg.startswith("warm-up ran out of device memory in its step of 64 tokens")
    assert f"needs {size(max(temps))} of temporaries" in msg, msg
    assert f"the weights ({size(weights)})" in msg and f"({size(cache)}, 40 pages)" in msg, msg
    for knob in ("--max-num-batched-tokens", "--gpu-memory-utilization", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        assert knob in msg
