"""`--load-format dummy` (vLLM's name): a model directory with only config.json and a tokenizer, random
weights drawn on the device from the seed; the serving benchmark runs against it with random-id prompts."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re

import pytest

from e2e_helpers import ServerThread

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--page-size", "8",
         "--dtype", "float32"]


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("dummy_model", os.path.join(ROOT, "benchmarks", "dummy_model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = str(tmp_path_factory.mktemp("dummy"))
    mod.write_dummy_model(os.path.join(ROOT, "configs", "models", "tiny-deepseek-v2.json"), out)
    assert sorted(os.listdir(out)) == ["config.json", "tokenizer.json", "tokenizer_config.json"]  # no weights
    return out


def test_dummy_weights_follow_the_seed(dummy_dir, xla_cache_dir):
    from deepinfer_jax import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = {}
    for seed in (0, 0, 1):  # one 16-slot bucket: the prompt and its 8 tokens fit, and warm-up compiles little
        llm = LLM(dummy_dir, load_format="dummy", seed=seed, dtype="float32", max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=16, progress=False)
        outs.setdefault(seed, []).append(llm.generate(["w5 w6 w7 w8"], sp)[0].outputs[0])
    (a, b), (c,) = outs[0], outs[1]
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    assert re.fullmatch(r"( ?w\d+)+", a.text), a.text  # every id decodes to its word
    with pytest.raises(ValueError, match="load_format"):
        LLM(dummy_dir, load_format="pt", progress=False)


def test_serving_benchmark_against_a_dummy_server(dummy_dir):
    from deepinfer_jax.server.bench import run_serving

    server = ServerThread(["--model", dummy_dir, "--load-format", "dummy", "--port", "0", *FLAGS]).start()
    try:
        res = asyncio.run(run_serving(server.url, input_len=10, output_len=5, concurrencies=[2], num_prompts=4,
                                      vocab_size=512, log=lambda s: None))
    finally:
        server.stop()
    (lv,) = res["levels"]
    assert lv["completed"] == 4 and lv["failed"] == 0
    assert lv["total_input_tokens"] == 40 and lv["total_output_tokens"] == 20
