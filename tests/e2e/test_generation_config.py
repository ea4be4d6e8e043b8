"""--generation-config (vLLM's): a generation_config.json's sampling defaults fill what a request leaves out, on
the session's live server through the `openai` client (its Serving's defaults set for the test, the params each
request reached the engine with recorded) and on the offline LLM; the flag's reading and its one-line errors."""

from __future__ import annotations

import json

import pytest

from e2e_helpers import MODEL

GEN = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
       "repetition_penalty": 1.1, "max_new_tokens": 5, "transformers_version": "4.46.3"}
MSG = [{"role": "user", "content": "Weather?"}]


@pytest.fixture
def gen_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(GEN))
    return str(tmp_path)


@pytest.fixture
def with_defaults(server, gen_dir):
    """set(source) puts load_sampling_defaults(gen_dir, source) on the live server; returns the params seen."""
    from deepinfer_jax.text.generation_config import load_sampling_defaults

    serving = server.server.serving
    seen, real, old = [], serving.submit, serving.config.sampling_defaults

    def submit(rid, ids, params, prompt, keep=()):
        seen.append(params)
        return real(rid, ids, params, prompt, keep)

    def set_(source):
        serving.config.sampling_defaults = load_sampling_defaults(gen_dir, source)
        return seen

    serving.submit = submit
    yield set_
    serving.submit, serving.config.sampling_defaults = real, old


def test_server_requests_take_the_file_defaults(client, with_defaults):
    seen = with_defaults("auto")
    r = client.chat.completions.create(model=MODEL, messages=MSG)
    p = seen[-1]
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (0.6, 0.95, 20, 1.1, 5)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    # the request's own fields win: temperature 0 is greedy, its max_tokens beats max_new_tokens (auto: no cap)
    r = client.chat.completions.create(model=MODEL, messages=MSG, temperature=0, max_tokens=8)
    p = seen[-1]
    assert (p.temperature, p.top_p, p.max_tokens) == (0.0, 0.95, 8) and r.usage.completion_tokens == 8
    client.completions.create(model=MODEL, prompt="Weather?")
    p = seen[-1]
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 20, 16)  # completions: max_tokens stays 16, as vLLM's


def test_server_vllm_ignores_the_file_and_a_folder_caps_max_tokens(client, with_defaults, gen_dir):
    seen = with_defaults("vllm")
    client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
    p = seen[-1]
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens) == (1.0, 1.0, 0, 1.0, 3)
    seen = with_defaults(gen_dir)  # a folder given by path: its max_new_tokens caps every request, as in vLLM
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=9)
    assert seen[-1].max_tokens == 5 and r.usage.completion_tokens == 5


def test_flag_through_a_server_of_its_own(scripted_model, xla_cache_dir, gen_dir, caplog):
    """`serve --generation-config DIR` end to end: the defaults logged at start, applied (its max_new_tokens caps a
    request's max_tokens) through the `openai` client."""
    from openai import OpenAI

    from e2e_helpers import API_KEY, SERVER_FLAGS, ServerThread

    with caplog.at_level("WARNING", logger="deepinfer_jax.server.app"):
        st = ServerThread(["--model", scripted_model[0], "--port", "0", *SERVER_FLAGS,
                           "--generation-config", gen_dir]).start()
    try:
        assert any("Default sampling parameters have been overridden" in r.message and "temperature=0.6" in r.message
                   for r in caplog.records)
        with OpenAI(base_url=st.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
            r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=9)
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    finally:
        st.stop()


def test_llm_default_sampling_params(scripted_model, xla_cache_dir, tmp_path, gen_dir):
    """The offline LLM: a call without sampling_params takes the file's (vLLM's get_default_sampling_params); a
    bad file stops LLM(...) before anything loads, naming the file and the key."""
    import shutil

    from deepinfer_jax import LLM, SamplingParams

    model = tmp_path / "model"
    shutil.copytree(scripted_model[0], model)
    (model / "generation_config.json").write_text(json.dumps(dict(GEN, top_p=1.5)))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be in \(0, 1\], got 1.5"):
        LLM(str(model), dtype="float32", progress=False)
    (model / "generation_config.json").write_text(json.dumps(GEN))
    llm = LLM(str(model), dtype="float32", max_model_len=512, max_num_seqs=16, max_num_batched_tokens=64,
              page_size=8, progress=False, compilation_cache_dir=xla_cache_dir)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.95, top_k=20,
                                                               repetition_penalty=1.1, max_tokens=5)
    out = llm.generate({"prompt_token_ids": [0, scripted_model[1]["<｜Assistant｜>"]]})[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


@pytest.mark.parametrize("content, error", [
    ('{"temperature": "hot"}', "generation_config.json: temperature must be a number, got 'hot'"),
    ('{"max_new_tokens": 0}', "generation_config.json: max_new_tokens must be a positive integer, got 0"),
    ('{"top_k": 2.5}', "generation_config.json: top_k must be an integer, got 2.5"),
    ("[1]", "generation_config.json: must be a JSON object, got list"),
    ("{", "generation_config.json is not valid JSON"),
])
def test_bad_file_is_one_line_usage_error(scripted_model, tmp_path, capsys, content, error):
    """`deepinfer serve --generation-config DIR` with a bad file: exit 2, one line naming the flag, file and key."""
    (tmp_path / "generation_config.json").write_text(content)
    from deepinfer_jax.server.args import check_engine_args, parse_with_config
    from deepinfer_jax.cli import _serve_parser

    parser = _serve_parser()
    ns = parse_with_config(parser, ["--model", scripted_model[0], "--generation-config", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        check_engine_args(parser, ns)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "error: argument --generation-config: " in err
    assert str(tmp_path / error) in err if error.startswith("generation_config.json") else error in err


def test_file_reading():
    """What vLLM reads of the file: the six keys (max_new_tokens as max_tokens), not those at Hugging Face's own
    defaults; "vllm" reads nothing; a folder without the file is an error."""
    import os
    import tempfile

    from deepinfer_jax.text.generation_config import load_sampling_defaults

    with tempfile.TemporaryDirectory() as d:
        assert load_sampling_defaults(d).values == {}  # auto without a file: no defaults
        with pytest.raises(ValueError, match="generation config .* is not a folder holding a generation_config.json"):
            load_sampling_defaults(d, d)
        with open(os.path.join(d, "generation_config.json"), "w") as f:
            json.dump({"temperature": 1.0, "top_k": 50, "top_p": 0.9, "min_p": 0.05, "max_new_tokens": 7,
                       "do_sample": True}, f)
        got = load_sampling_defaults(d)
        assert got.values == {"top_p": 0.9, "min_p": 0.05, "max_tokens": 7} and got.max_tokens_cap is None
        assert "top_p=0.9" in got.log_line() and "--generation-config vllm" in got.log_line()
        assert load_sampling_defaults(d, d).max_tokens_cap == 7
        assert load_sampling_defaults(d, "vllm").values == {} and load_sampling_defaults(d, "vllm").log_line() is None
