"""Compiled step programs kept on disk (runner/program_cache.py): a second engine with the same model,
configuration and code loads every step program without tracing it and generates HF's greedy tokens;
a broken entry is compiled again and rewritten; the key changes with anything the program is made from;
a program JAX's own compilation cache served is not stored.

Which compiles JAX's own compilation cache serves depends on what ran before (it may be the user's
~/.cache): each test sets it explicitly (`_jax_cache`): off, so that XLA compiles, or a fresh directory."""

from __future__ import annotations

import contextlib
import os
import pickle

import jax
import jax.numpy as jnp
import pytest

from deepinfer_jax.config import CacheConfig, RunnerConfig, SchedulerConfig
from deepinfer_jax.engine.llm_engine import LLMEngine
from deepinfer_jax.runner import program_cache
from deepinfer_jax.types import SamplingParams
from deepinfer_jax.weights.loader import load_model
from hf_models import random_prompts

N_NEW = 6


def _engine(path, cache_dir, max_model_len, **runner_kw):
    """Both buckets are prefill buckets (16 and 64 slots for 4 sequence rows): one whole program each, unless
    the test asks for RunnerConfig.prefill_shared_forward."""
    runner_kw.setdefault("prefill_shared_forward", False)
    cfg, params = load_model(path, jnp.float32, progress=False)
    rc = RunnerConfig(dtype="float32", attn_impl="reference", moe_impl="ragged", token_buckets=(16, 64),
                      warmup_full_variant=False, program_cache_dir=str(cache_dir), **runner_kw)
    return LLMEngine(cfg, params, None, scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                                         max_model_len=max_model_len),
                     cache_config=CacheConfig(page_size=8), runner_config=rc, progress=False)


def _greedy(eng, prompts):
    ids = []
    for p in prompts:
        ids.append(eng.new_request_id())
        eng.add_request(ids[-1], p, SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[r] for r in ids]


@contextlib.contextmanager
def _jax_cache(path):
    """JAX's persistent compilation cache in `path` for the block (None: off, so every compile is XLA's
    own), as it was afterwards."""
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    jax.config.update("jax_compilation_cache_dir", None if path is None else str(path))
    jax.config.update("jax_enable_compilation_cache", path is not None)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_enable_compilation_cache", before[1])
        compilation_cache.reset_cache()


@pytest.fixture
def xla_compiles():
    with _jax_cache(None):
        yield


def _entries(cache_dir):
    return sorted(os.path.join(cache_dir, f) for f in os.listdir(cache_dir) if f.endswith(".program"))


def test_a_second_engine_loads_every_program_and_matches_hf(hf_case, hf_greedy, tmp_path, xla_compiles):
    model, path = hf_case("v2_greedy_yarn")
    prompts = random_prompts(40, [7, 19, 3], model.config.vocab_size)

    first = _engine(path, tmp_path, 128)
    assert first.runner.programs_loaded == 0
    assert len(_entries(tmp_path)) == first.num_warmup_compiles == 2  # buckets 16 and 64, base variant
    want = _greedy(first, prompts)

    second = _engine(path, tmp_path, 128)
    assert second.runner.programs_loaded == second.num_warmup_compiles == 2
    assert second.runner.programs.jitted == {}  # nothing was traced or lowered
    got = _greedy(second, prompts)
    assert got == want
    assert got == [hf_greedy(model, p, N_NEW) for p in prompts]
    assert second.runner.compiles_after_warmup == 0


def test_shared_prefill_forwards_and_their_samplers_are_stored_and_loaded(hf_case, hf_greedy, tmp_path, xla_compiles):
    """RunnerConfig.prefill_shared_forward: both buckets (16 and 64 slots for 4 sequence rows) are prefill
    buckets, so each compiles its forward as a program of its own, and the two share one base sampler (their
    outputs have the same shape); a second engine loads all three and generates HF's tokens."""
    model, path = hf_case("v2_greedy_yarn")
    prompts = random_prompts(43, [7, 19, 3], model.config.vocab_size)
    first = _engine(path, tmp_path, 160, prefill_shared_forward=True)
    assert len(_entries(tmp_path)) == first.num_warmup_compiles == 3
    assert sorted(pid[0] for pid in first.runner.programs.executables) == ["forward", "forward", "sampler"]
    want = _greedy(first, prompts)
    second = _engine(path, tmp_path, 160, prefill_shared_forward=True)
    assert second.runner.programs_loaded == second.num_warmup_compiles == 3
    assert second.runner.programs.jitted == {}  # nothing was traced or lowered
    got = _greedy(second, prompts)
    assert got == want == [hf_greedy(model, p, N_NEW) for p in prompts]
    assert second.runner.compiles_after_warmup == 0


def test_a_broken_entry_is_compiled_again_and_rewritten(hf_case, tmp_path, xla_compiles):
    model, path = hf_case("v2_greedy_yarn")
    prompts = random_prompts(41, [11, 5], model.config.vocab_size)
    want = _greedy(_engine(path, tmp_path, 136), prompts)
    for entry in _entries(tmp_path):
        with open(entry, "wb") as f:
            f.write(b"not a program")

    eng = _engine(path, tmp_path, 136)
    assert eng.runner.programs_loaded == 0
    assert _greedy(eng, prompts) == want
    for entry in _entries(tmp_path):  # whole entries again
        with open(entry, "rb") as f:
            blob, _, _ = pickle.load(f)
        assert len(blob) > 1000


def test_a_different_configuration_is_a_different_program(hf_case, tmp_path, xla_compiles):
    _, path = hf_case("v2_greedy_yarn")
    _engine(path, tmp_path, 144)
    other = _engine(path, tmp_path, 144, collect_routing=True)  # both programs also return the routing
    assert other.runner.programs_loaded == 0
    assert len(_entries(tmp_path)) == 4


def test_a_program_jax_cache_served_is_not_stored(hf_case, tmp_path):
    """An engine whose programs JAX's compilation cache serves (XLA compiled them for the first engine)
    stores nothing: re-serialized, such a program lost its compiled functions on XLA:CPU and failed at
    its first run. A later engine on that directory compiles again and runs."""
    model, path = hf_case("v2_greedy_yarn")
    prompts = random_prompts(42, [9, 4], model.config.vocab_size)
    with _jax_cache(tmp_path / "jax"):
        first = _engine(path, tmp_path / "first", 152)
        assert len(_entries(tmp_path / "first")) == 2
        want = _greedy(first, prompts)
        served = _engine(path, tmp_path / "served", 152)
        assert served.runner.programs_loaded == 0 and not os.path.exists(tmp_path / "served")
        assert _greedy(served, prompts) == want
        again = _engine(path, tmp_path / "served", 152)
        assert again.runner.programs_loaded == 0 and _greedy(again, prompts) == want


def test_the_key_covers_the_source_and_the_arguments(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "notes.txt").write_text("not code\n")
    before = program_cache.source_fingerprint(str(pkg))
    (pkg / "notes.txt").write_text("still not code\n")
    program_cache.source_fingerprint.cache_clear()
    assert program_cache.source_fingerprint(str(pkg)) == before
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    program_cache.source_fingerprint.cache_clear()
    assert program_cache.source_fingerprint(str(pkg)) != before
    program_cache.source_fingerprint.cache_clear()

    a = program_cache.signature((jnp.zeros((2, 3)), {"w": jnp.zeros(4, jnp.int32)}))
    assert a == program_cache.signature((jnp.ones((2, 3)), {"w": jnp.ones(4, jnp.int32)}))  # values do not count
    assert a != program_cache.signature((jnp.zeros((2, 3)), {"w": jnp.zeros(5, jnp.int32)}))
    assert a != program_cache.signature((jnp.zeros((2, 3), jnp.bfloat16), {"w": jnp.zeros(4, jnp.int32)}))
    assert program_cache.program_key(RunnerConfig(), a) == program_cache.program_key(RunnerConfig(), a)
    assert program_cache.program_key(RunnerConfig(), a) != program_cache.program_key(RunnerConfig(seed=1), a)


def test_the_directory_keeps_its_most_recently_used_programs_within_the_cap(tmp_path, xla_compiles):
    """store() prunes to the byte cap, least recently used first (a load counts as a use), never the
    entry it just wrote; a crashed writer's old temporary file goes too."""
    device = jax.devices()[0]
    # Three programs of one form (entries of nearly one size).
    progs = {n: jax.jit(lambda x, n=n: x * n + 1.0).lower(jnp.zeros(4)).compile() for n in (1, 2, 3)}
    assert program_cache.store(str(tmp_path), "a", progs[1]) and program_cache.store(str(tmp_path), "b", progs[2])
    size = max(os.path.getsize(tmp_path / f"{k}.program") for k in "ab")
    os.utime(tmp_path / "a.program", (1e9, 1e9))  # a is older than b ...
    os.utime(tmp_path / "b.program", (1e9 + 10, 1e9 + 10))
    stale = tmp_path / "c.program.123.part"
    stale.write_bytes(b"half a program")
    os.utime(stale, (1e9, 1e9))
    loaded = program_cache.load(str(tmp_path), "a", device)  # ... until a load uses it
    assert float(loaded(jnp.ones(4))[0]) == 2.0
    # Room for two entries: storing c deletes the least recently used one, b, and the stale part file.
    assert program_cache.store(str(tmp_path), "c", progs[3], max_bytes=2 * size + size // 2)
    assert sorted(os.listdir(tmp_path)) == ["a.program", "c.program"]
    assert float(program_cache.load(str(tmp_path), "c", device)(jnp.ones(4))[0]) == 4.0
    # A cap below one entry still keeps the one just written.
    assert program_cache.store(str(tmp_path), "b", progs[2], max_bytes=1)
    assert os.listdir(tmp_path) == ["b.program"]
