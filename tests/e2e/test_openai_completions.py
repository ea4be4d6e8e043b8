"""/v1/completions through the openai client (every prompt form, echo, logprobs, streaming, usage), and
the small endpoints: /v1/models, /health, /version, /tokenize, /detokenize, /metrics."""

from __future__ import annotations

import aiohttp
import asyncio
import pytest

from e2e_helpers import MODEL, parse_metrics
from scripted import CONTENT, REASONING

ASSISTANT = "<｜Assistant｜>"
EXPECTED = "<think>" + REASONING + "</think>" + CONTENT  # the first 4 script tokens after <｜Assistant｜>


def test_string_prompt(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt="Hi" + ASSISTANT, max_tokens=4)
    c = r.choices[0]
    assert c.text == EXPECTED and c.finish_reason == "length" and r.object == "text_completion"
    n = len(tokenizer.encode("Hi" + ASSISTANT))
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == n
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_prompt_forms_and_choice_order(client, scripted_model):
    _, ids = scripted_model
    a = ids[ASSISTANT]
    r = client.completions.create(model=MODEL, prompt=[ASSISTANT, "x" + ASSISTANT], max_tokens=2, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text == "<think>" + REASONING for c in r.choices)
    r = client.completions.create(model=MODEL, prompt=[0, a], max_tokens=1)
    assert r.choices[0].text == "<think>" and r.usage.prompt_tokens == 2
    r = client.completions.create(model=MODEL, prompt=[[0, a], [a]], max_tokens=1)
    assert [c.text for c in r.choices] == ["<think>", "<think>"] and r.usage.prompt_tokens == 3


def test_echo_and_stop_and_ignore_eos(client):
    r = client.completions.create(model=MODEL, prompt="Hi" + ASSISTANT, max_tokens=4, echo=True)
    assert r.choices[0].text == "Hi" + ASSISTANT + EXPECTED  # the prompt text comes back as written
    r = client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=40, stop=["check"])
    assert r.choices[0].text == "<think>Let me " and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=40, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=40)
    assert r.usage.completion_tokens == 15 and r.choices[0].finish_reason == "stop"  # EOS ends the script


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["<think>", REASONING, "</think>"]
    assert all(v == pytest.approx(0.0, abs=1e-3) for v in lp.token_logprobs)
    assert all(len(t) == 2 and list(t.values())[0] == pytest.approx(0.0, abs=1e-3) for t in lp.top_logprobs)
    assert lp.text_offset == [0, 7, 7 + len(REASONING)]


def test_echo_with_logprobs_scores_the_prompt(client, tokenizer):
    """echo + logprobs: the prompt's tokens come first, the first without a logprob; the prompt's scores are the
    model's (a generated token scored as part of the next prompt gets the logprob it was sampled with); streamed,
    the same entries arrive."""
    prompt = "Hi" + ASSISTANT
    ids = tokenizer.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt + "<think>" + REASONING
    assert len(lp.tokens) == len(ids) + 2 and lp.tokens[-2:] == ["<think>", REASONING]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) in (1, 2) for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    # The generated tokens, scored as prompt tokens, get the logprobs they were sampled with.
    again = client.completions.create(model=MODEL, prompt=prompt + "<think>" + REASONING, max_tokens=1, logprobs=1,
                                      echo=True).choices[0].logprobs
    assert again.tokens[: len(ids) + 2] == lp.tokens
    assert again.token_logprobs[1: len(ids) + 2] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logprobs=1, echo=True,
                                            stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((x.tokens for x in streamed), []) == lp.tokens
    values = sum((x.token_logprobs for x in streamed), [])
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_prompt_logprobs_and_best_of(client, tokenizer):
    ids = tokenizer.encode("Hi" + ASSISTANT)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    assert all(str(t) in e and e[str(t)]["rank"] >= 1 and e[str(t)]["logprob"] <= 0 for t, e in zip(ids[1:], plp[1:]))
    echo = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=2, echo=True)
    assert [e[str(t)]["logprob"] for t, e in zip(ids[1:], plp[1:])] == pytest.approx(
        echo.choices[0].logprobs.token_logprobs[1: len(ids)], abs=1e-6)
    # best_of: the scripted model is deterministic, so every one of the 3 sequences is the script; n=1 comes back.
    r = client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=4, best_of=3, temperature=1.0)
    assert [c.text for c in r.choices] == [EXPECTED] and r.choices[0].logprobs is None


def test_streaming(client):
    chunks = list(client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=4, stream=True, logprobs=0,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == EXPECTED
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []
    toks = sum((c.choices[0].logprobs.tokens for c in chunks if c.choices and c.choices[0].logprobs), [])
    assert toks == ["<think>", REASONING, "</think>", CONTENT]
    chunks = list(client.completions.create(model=MODEL, prompt=[ASSISTANT, ASSISTANT], max_tokens=2, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]  # vLLM's continuous usage: the tokens so far, every chunk
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 4 and chunks[-1].choices == []
    echo = list(client.completions.create(model=MODEL, prompt="Hi" + ASSISTANT, max_tokens=1, stream=True,
                                          echo=True))
    assert "".join(c.choices[0].text for c in echo) == "Hi" + ASSISTANT + "<think>"


def test_models_health_version(client, server, tokenizer):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, "other-name"]
    assert models[0].model_extra["max_model_len"] == 512

    async def go():
        async with aiohttp.ClientSession(server.url) as s:
            async with s.get("/health") as r:
                assert r.status == 200
            async with s.get("/version") as r:
                assert (await r.json())["version"]
            async with s.post("/tokenize", json={"prompt": "Hi" + ASSISTANT}) as r:
                tok = await r.json()
                assert tok["tokens"] == tokenizer.encode("Hi" + ASSISTANT) and tok["tokens"][0] == 0
                assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
            async with s.post("/tokenize", json={"prompt": "Hi" + ASSISTANT, "return_token_strs": True}) as r:
                assert (await r.json())["token_strs"] == [tokenizer.decode([t]) for t in tok["tokens"]]
            async with s.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}) as r:
                chat = await r.json()
                assert chat["tokens"][0] == 0 and chat["count"] == len(chat["tokens"]) >= 3
            async with s.post("/detokenize", json={"tokens": tok["tokens"]}) as r:
                assert (await r.json())["prompt"] == "<｜begin▁of▁sentence｜>Hi" + ASSISTANT
            async with s.get("/metrics") as r:
                body = await r.text()
                assert r.headers["Content-Type"].startswith("text/plain")
        return body

    m = parse_metrics(asyncio.run(go()))
    label = (("model_name", MODEL),)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "inter_token_latency_seconds_sum", "time_to_first_token_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count", "prompt_tokens_total",
                 "generation_tokens_total"):
        assert ("deepinfer:" + name, label) in m, name
    assert m[("deepinfer:time_to_first_token_seconds_count", label)] > 0
    assert m[("deepinfer:generation_tokens_total", label)] > 0
    assert m[("deepinfer:request_success_total", (("finished_reason", "length"), ("model_name", MODEL)))] > 0


def test_stop_token_ids(client, scripted_model):
    _, ids = scripted_model
    r = client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=40,
                                  extra_body={"stop_token_ids": [ids["</think>"]]})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == ids["</think>"]
    assert c.text == "<think>" + REASONING + "</think>" and r.usage.completion_tokens == 3


def test_stop_string_across_tokens_streamed(client):
    """A stop string that starts inside one token and ends in a later one: a stream holds back the text that may
    begin it, so no chunk carries any of it; the streamed text is the non-streamed one."""
    stop = "weather.</think>I"  # "Let me check the weather." + "</think>" + "I will look it up."
    plain = client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=20, stop=[stop])
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=20,
                                                              stop=["zzz", stop], stream=True) if c.choices]
    assert plain.choices[0].text == "".join(c.text for c in chunks) == "<think>Let me check the "
    assert not any("weather" in c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" and chunks[-1].model_extra["stop_reason"] == stop
    ten = client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=20, stop=[f"z{i}" for i in range(9)] +
                                    ["check"])  # more than OpenAI's 4 stop strings: honoured, as vLLM does
    assert ten.choices[0].text == "<think>Let me " and ten.choices[0].model_extra["stop_reason"] == "check"
    kept = client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=20, stop=[stop], stream=True,
                                     extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in kept if c.choices) == "<think>Let me check the " + stop


def test_stop_string_on_the_last_allowed_token(client, scripted_model, server):
    """The token that reaches max_tokens also completes a stop string: the text ends at the stop string and the
    finish reason is "stop" (as vLLM), streamed or not. A stop token id there is "length" (vLLM checks the length
    first); min_tokens holds back up to 8 stop ids and EOS (test_errors.py refuses a ninth)."""
    _, ids = scripted_model
    r = client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=3, stop=["</think>"])
    c = r.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == ("<think>" + REASONING, "stop", "</think>")
    last = [ch.choices[0] for ch in client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=3,
                                                              stop=["</think>"], stream=True) if ch.choices][-1]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == "</think>"
    r = client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=3,
                                  extra_body={"stop_token_ids": [ids["</think>"]]})
    assert r.choices[0].finish_reason == "length"
    eos = len(server.engine.engine.eos_token_ids)
    held = list(range(100, 107 - eos)) + [ids["</think>"]]  # with the EOS ids, 8: all held back until min_tokens
    r = client.completions.create(model=MODEL, prompt=ASSISTANT, max_tokens=6, logprobs=0,
                                  extra_body={"min_tokens": 4, "stop_token_ids": held, "skip_special_tokens": False})
    assert "</think>" not in r.choices[0].logprobs.tokens[:4]
