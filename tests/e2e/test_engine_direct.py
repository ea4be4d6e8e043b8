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


@pytest.mark.parametrize("stop", [None, ["look it"]])
def test_output_kinds_return_the_same_output(llm, scripted_model, stop):
    """CUMULATIVE, DELTA and FINAL_ONLY (vLLM's RequestOutputKind) over the same requests: the deltas
    add up to the cumulative outputs, step by step, and FINAL_ONLY returns the last of them once."""
    from deepinfer_jax.types import RequestOutputKind as Kind, SamplingParams

    _, ids = scripted_model
    eng, tok = llm.engine, llm.tokenizer
    prompt = [0, ids["<｜Assistant｜>"]]

    def run(kind):
        sp = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=1, stop=stop,
                            output_kind=kind)
        eng.add_request("kinds", prompt, sp)
        steps = []
        while eng.has_unfinished_requests():
            steps.append([o for o in eng.step() if o.request_id == "kinds"])
        return steps

    cumulative, delta, final = run(Kind.CUMULATIVE), run(Kind.DELTA), run(Kind.FINAL_ONLY)
    want = [o for step in cumulative for o in step][-1]
    assert want.finished and [c.index for c in want.outputs] == [0, 1]
    assert [o for step in final for o in step] == [want]
    assert len(delta) == len(cumulative) == len(final)
    sums = {0: ("", [], []), 1: ("", [], [])}
    for d_step, c_step in zip(delta, cumulative):
        assert len(d_step) == len(c_step) <= 1
        for d, c in zip(d_step, c_step):
            assert d.finished == c.finished
            for dc in d.outputs:
                assert len(dc.token_ids) <= 1 and len(dc.logprobs) == len(dc.token_ids)
                text, toks, lps = sums[dc.index]
                sums[dc.index] = (text + dc.text, toks + dc.token_ids, lps + dc.logprobs)
                cc = c.outputs[dc.index]
                assert sums[dc.index] == (cc.text, cc.token_ids, cc.logprobs)
                assert (dc.finish_reason, dc.stop_reason, dc.cumulative_logprob) == (
                    cc.finish_reason, cc.stop_reason, cc.cumulative_logprob)
    for c in want.outputs:
        assert sums[c.index] == (c.text, c.token_ids, c.logprobs)
        full = tok.decode(c.token_ids, skip_special_tokens=True)
        if stop is None:
            assert c.finish_reason == "length" and len(c.token_ids) == 12 and c.text == full
        else:
            assert c.finish_reason == "stop" and c.stop_reason == "look it"
            assert c.text == full[: full.index("look it")] and c.text.endswith("I will ")
    assert eng.scheduler.kv_cache_manager.usage == 0.0


def test_structured_output_after_reasoning(llm, scripted_model):
    """StructuredOutputsParams.after_token_id (what the server sets when the prompt opens the reasoning): the
    scripted reasoning and `</think>` come out as the model writes them, then the grammar holds the answer."""
    from deepinfer_jax import SamplingParams, StructuredOutputsParams

    _, ids = scripted_model
    prompt = [0, ids["<｜Assistant｜>"], ids["<think>"]]
    gated = StructuredOutputsParams(choice=["yes", "no"], after_token_id=ids["</think>"])
    [out] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=20,
                                                                          structured_outputs=gated))
    o = out.outputs[0]
    assert o.token_ids[:2] == [ids["Let me check the weather."], ids["</think>"]]
    assert o.text.endswith("yes") or o.text.endswith("no")
    assert o.finish_reason == "stop"
    [free] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    assert free.outputs[0].text in ("yes", "no")
