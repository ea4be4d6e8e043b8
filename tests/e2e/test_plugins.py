"""Plugins through a real server started with --plugin (sample_plugins.py): a PII redactor rewriting requests
on the text threads and rejecting some, a profanity filter on streamed output across chunk boundaries, a
plugin route, and a failing plugin: a 500 (or an in-band error and [DONE]) for that request only, logged
with the plugin's name."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import openai
import pytest

from e2e_helpers import API_KEY, MODEL, SERVER_FLAGS, ServerThread

PROMPT = "<｜User｜>hi<｜Assistant｜>"  # the scripted model then says its script (scripted.py)


@pytest.fixture(scope="module")
def plugin_server(scripted_model, xla_cache_dir):
    st = ServerThread(["--model", scripted_model[0], "--port", "0", *SERVER_FLAGS,
                       "--plugin", "sample_plugins:PIIRedactor", "--plugin", "sample_plugins:ProfanityFilter",
                       "sample_plugins:Exploding"]).start()
    yield st
    st.stop()


@pytest.fixture
def pclient(plugin_server):
    with openai.OpenAI(base_url=plugin_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def _plugin(server, name):
    return next(p for p in server.server.serving.plugins.plugins if p.name == name)


def test_pii_redacted_before_tokenizing(plugin_server, pclient):
    out = pclient.completions.create(model=MODEL, prompt="mail bob@example.com or call +1 555 123 4567 now",
                                     max_tokens=1, echo=True)
    assert out.choices[0].text.startswith("mail [email] or call [phone] now")
    msg = [{"role": "user", "content": "I am ann@corp.org"}]
    chat = pclient.chat.completions.create(model=MODEL, messages=msg, max_tokens=1)
    redacted = [{"role": "user", "content": "I am [email]"}]

    async def count(messages):
        async with aiohttp.ClientSession(plugin_server.url) as s:
            async with s.post("/tokenize", json={"messages": messages}) as r:
                return (await r.json())["count"]

    assert chat.usage.prompt_tokens == asyncio.run(count(redacted)) != asyncio.run(count(msg))

    async def stats():
        async with aiohttp.ClientSession(plugin_server.url) as s:
            async with s.get("/plugins/pii-redactor") as r:
                return r.status, await r.json()

    status, st = asyncio.run(stats())  # the plugin's own route
    assert status == 200 and st["redacted"] >= 3
    assert st["threads"] and all(t.startswith("deepinfer-text") for t in st["threads"])  # blocking: off the loop


def test_plugin_rejects_with_openai_error(pclient):
    with pytest.raises(openai.BadRequestError) as e:
        pclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "card 4111 1111 1111 1111"}],
                                        max_tokens=1)
    assert e.value.body["code"] == "pii_rejected" and "payment card" in e.value.body["message"]


def test_profanity_filter_across_chunks(plugin_server, pclient):
    filt = _plugin(plugin_server, "profanity-filter")
    before = filt.split_matches
    stream = pclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, stream=True,
                                        extra_body={"ignore_eos": True})
    chunks = [c.choices[0].text for c in stream if c.choices]
    text = "".join(chunks)
    assert "weather.</think>I will" not in text and "check the" not in text
    assert text.count("*" * len("weather.</think>I will")) >= 2 and text.count("*" * len("check the")) >= 2
    assert len([c for c in chunks if c]) > 4
    assert filt.split_matches > before, "no banned phrase straddled two deltas in this run"
    plain = pclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12)
    assert plain.choices[0].text.startswith("<think>Let me " + "*" * 9 + " " + "*" * 22 + " look it up.")


def test_failing_plugin_is_a_500_for_that_request_only(plugin_server, pclient, caplog):
    with caplog.at_level(logging.ERROR, logger="deepinfer_jax.server.plugins"):
        with pytest.raises(openai.InternalServerError) as e:
            pclient.completions.create(model=MODEL, prompt="please explode", max_tokens=2)
    assert e.value.body["code"] == "plugin_error" and "exploding" in e.value.body["message"]
    assert any("plugin exploding failed in on_request" in r.getMessage() and r.exc_info for r in caplog.records)

    async def stream():
        async with aiohttp.ClientSession(plugin_server.url) as s:
            async with s.post("/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": "explode-later"}],
                                    "stream": True, "max_tokens": 5}) as r:
                return r.status, await r.text()

    status, text = asyncio.run(stream())
    events = [e for e in text.split("\n\n") if e]
    assert status == 200 and events[-1] == "data: [DONE]"
    err = json.loads(events[-2][len("data: "):])["error"]
    assert "exploding" in err["message"] and "on_delta" in err["message"]
    # the server goes on serving
    out = pclient.completions.create(model=MODEL, prompt="fine", max_tokens=2)
    assert out.choices[0].finish_reason == "length"


def test_plugin_loading(tmp_path, monkeypatch):
    """--plugin errors name the flag; YAML takes a list; an installed entry point of deepinfer.plugins loads
    (DEEPINFER_PLUGINS picks which)."""
    from deepinfer_jax.cli import _serve_parser
    from deepinfer_jax.server.args import parse_with_config
    from deepinfer_jax.server.plugins import load_plugins

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("plugin: [sample_plugins:PIIRedactor, sample_plugins:Exploding]\n")
    ns = parse_with_config(_serve_parser(), ["--config", str(cfg), "--plugin", "sample_plugins:ProfanityFilter"])
    assert ns.plugin == ["sample_plugins:PIIRedactor", "sample_plugins:Exploding", "sample_plugins:ProfanityFilter"]
    dist = tmp_path / "site" / "acme_plugins-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-plugins\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[deepinfer.plugins]\nredactor = sample_plugins:PIIRedactor\n"
                                           "filter = sample_plugins:ProfanityFilter\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv("DEEPINFER_PLUGINS", raising=False)
    assert {p.name for p in load_plugins([])} >= {"pii-redactor", "profanity-filter"}
    monkeypatch.setenv("DEEPINFER_PLUGINS", "filter")
    assert [p.name for p in load_plugins([])] == ["profanity-filter"]
    monkeypatch.setenv("DEEPINFER_PLUGINS", "")
    assert load_plugins([]) == []

    for spec, msg in (("nomodule_xyz:P", "cannot import"), ("sample_plugins:Nope", "no attribute"),
                      ("sample_plugins", "expected module:attr"), ("sample_plugins:EMAIL", "not a plugin")):
        with pytest.raises(ValueError, match=msg):
            load_plugins([spec], entry_points=False)
