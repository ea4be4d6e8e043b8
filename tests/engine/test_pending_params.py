"""The weights load while warm-up compiles (weights/pending.py): the engine lowers and compiles its step programs
from the params' abstract tree, takes the arrays for its warm-up runs, and then generates exactly what HF
transformers does. A loader whose arrays do not fit the tree it announced is an error, not a recompile."""

from __future__ import annotations

import logging
import threading

import jax
import jax.numpy as jnp
import pytest

from hf_models import random_prompts
from deepinfer_jax import SamplingParams
from deepinfer_jax.config import CacheConfig, RunnerConfig, SchedulerConfig
from deepinfer_jax.engine.llm_engine import LLMEngine
from deepinfer_jax.runner.step_programs import program_kind
from deepinfer_jax.weights.loader import prepare_model
from deepinfer_jax.weights.pending import PendingParams


class _Seen(logging.Handler):
    """Sets `event` at the first log record containing `text`."""

    def __init__(self, text: str):
        super().__init__(logging.INFO)
        self.text, self.event = text, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


def _engine(cfg, params) -> LLMEngine:
    return LLMEngine(cfg, params, None,
                     scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256),
                     cache_config=CacheConfig(page_size=8), runner_config=RunnerConfig(dtype="float32"),
                     progress=False)


def test_weights_load_while_warmup_compiles(hf_case, hf_greedy):
    model, path = hf_case("v2_greedy_yarn")
    cfg, pending = prepare_model(path, jnp.float32, progress=False)
    # The load is held until warm-up has compiled a step program: were the programs waiting for the weights,
    # the hold would time out.
    logger = logging.getLogger("deepinfer_jax.runner.warmup")
    seen, level = _Seen("warm-up: compiled the"), logger.level
    logger.addHandler(seen)
    logger.setLevel(logging.INFO)
    held = {}

    def held_load():
        held["compiled first"] = seen.event.wait(timeout=120)
        held["thread"] = threading.current_thread().name
        return pending.load()

    try:
        eng = _engine(cfg, PendingParams(pending.abstract, held_load))
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
    assert held == {"compiled first": True, "thread": "deepinfer-load-weights"}
    # where the start went (ModelRunner.startup_seconds): the load, held until a program compiled, and warm-up's
    # lowering, its wait for the weights and its whole, each within it
    took = eng.runner.startup_seconds
    assert 0 < took["lowered"] < took["warmup"] and 0 <= took["weights_waited"] < took["warmup"]
    assert took["weights"] > 0
    # warm-up lowered the slowest programs first: the prefill buckets' shared forwards, the whole steps, the samplers
    kinds = [program_kind(pid)[0] for pid in eng.runner.warmup_plan()[1]]
    assert kinds == sorted(kinds, key=["forward", "step", "sampler"].index) and set(kinds) == {"forward", "step",
                                                                                                 "sampler"}
    assert eng.runner.compiles_after_warmup == 0
    prompts = random_prompts(3, [5, 40, 1, 70], cfg.vocab_size)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[f"r{i}"] for i in range(len(prompts))] == [hf_greedy(model, p, 6) for p in prompts]
    assert eng.runner.compiles_after_warmup == 0


def test_a_loader_that_breaks_its_word_is_an_error(hf_case):
    _, path = hf_case("v2_greedy_yarn")
    cfg, pending = prepare_model(path, jnp.float32, progress=False)

    def bf16_load():  # every leaf in another dtype than announced
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16), pending.load())

    with pytest.raises(RuntimeError, match=r"the loaded param \['embed'\] is .*bfloat16.*announced as .*float32"):
        _engine(cfg, PendingParams(pending.abstract, bf16_load))

    def failing_load():
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        PendingParams(pending.abstract, failing_load).result()
