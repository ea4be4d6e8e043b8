"""The scripted checkpoint on the engine itself (no HTTP): greedy and sampled output follow the script
exactly, and AsyncEngine streams it as deltas (what the server tests build on)."""

from __future__ import annotations

import asyncio

import pytest

from scripted import SCRIPT


@pytest.fixture(scope="module")
def llm(scripted_model, xla_cache_dir):
    from deepinfer_jax import LLM

    return LLM(scripted_model[0], dtype="float32", max_model_len=512, max_num_seqs=16, max_num_batched_tokens=64,
               page_size=8, progress=False, compilation_cache_dir=xla_cache_dir)


def test_engine_follows_the_script(llm, scripted_model):
    from deepinfer_jax import SamplingParams

    _, ids = scripted_model
    want = [ids[t] for t in SCRIPT[1:-1]]  # after <｜Assistant｜>, up to and including EOS
    msgs = [{"role": "user", "content": "Weather?"}]
    for temp in (0.0, 1.0):
        out = llm.chat(msgs, SamplingParams(temperature=temp, max_tokens=40, logprobs=0))[0].outputs[0]
        assert out.token_ids == want and out.finish_reason == "stop"
        assert all(abs(e[t].logprob) < 1e-3 for e, t in zip(out.logprobs, out.token_ids))


def test_async_engine_streams_deltas(llm, scripted_model):
    from deepinfer_jax import SamplingParams
    from deepinfer_jax.engine.async_engine import AsyncEngine

    _, ids = scripted_model
    eng = AsyncEngine(lambda: llm.engine, max_queue_len=4).start()
    assert eng.wait_ready(10)

    async def go():
        prompt = [0, ids["<｜Assistant｜>"]]
        outs = [o async for o in eng.submit("r1", prompt, SamplingParams(temperature=0.0, max_tokens=6))]
        aborted = eng.submit("r2", prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        async for _ in aborted:
            break
        aborted.abort()
        return outs

    outs = asyncio.run(go())
    assert sum((o.outputs[0].token_ids for o in outs), []) == [ids[t] for t in SCRIPT[1:7]]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    eng.shutdown()
    assert not eng.thread_alive
    assert llm.engine.scheduler.kv_cache_manager.usage == 0.0 and not llm.engine.has_unfinished_requests()
