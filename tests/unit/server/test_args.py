"""CLI flags, the YAML config (flags override it), the example configs, and `deepinfer convert`."""

from __future__ import annotations

import glob
import os

import pytest

from deepinfer_jax.cli import _serve_parser, main
from deepinfer_jax.server.args import DEFAULT_MODEL_DIR, engine_kwargs, parse_with_config, resolve_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_defaults_and_vllm_names():
    ns = parse_with_config(_serve_parser(), [])
    assert (ns.host, ns.port, ns.enable_prefix_caching, ns.page_size) == ("127.0.0.1", 8000, True, 64)
    assert resolve_model(ns) == (DEFAULT_MODEL_DIR, "deepinfer-default")
    kw = engine_kwargs(ns)  # the embedded demo model gets small sizes unless flags say otherwise
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["max_model_len"]) == (32, 256, 2048)
    kw = engine_kwargs(parse_with_config(_serve_parser(), ["--max-num-seqs", "4"]))
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"]) == (4, 256)
    kw = engine_kwargs(parse_with_config(_serve_parser(), ["--model", "/m"]))
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["max_model_len"]) == (256, None, None)
    ns = parse_with_config(_serve_parser(), ["--block-size", "16", "--no-enable-prefix-caching", "-tp", "1",
                                             "--served-model-name", "a", "b", "--model", "/m"])
    assert ns.page_size == 16 and not ns.enable_prefix_caching and ns.served_model_name == ["a", "b"]
    kw = engine_kwargs(ns)
    assert kw["page_size"] == 16 and kw["enable_prefix_caching"] is False and "attn_impl" not in kw
    assert "unroll_max_tokens" not in kw  # the engine's default (256 on a GPU)
    kw = engine_kwargs(parse_with_config(_serve_parser(), ["--model", "/m", "--unroll-max-tokens", "0"]))
    assert kw["unroll_max_tokens"] == 0 and "prefill_layers" not in kw
    kw = engine_kwargs(parse_with_config(_serve_parser(), ["--model", "/m", "--prefill-layers", "indexed"]))
    assert kw["prefill_layers"] == "indexed"
    assert "prefill_context_variant" not in kw  # LLM's default (on)
    kw = engine_kwargs(parse_with_config(_serve_parser(), ["--model", "/m", "--prefill-context-variant"]))
    assert kw["prefill_context_variant"] is True
    kw = engine_kwargs(parse_with_config(_serve_parser(), ["--model", "/m", "--no-prefill-context-variant"]))
    assert kw["prefill_context_variant"] is False and "greedy_variant" not in kw
    kw = engine_kwargs(parse_with_config(_serve_parser(), ["--model", "/m", "--no-greedy-variant"]))
    assert kw["greedy_variant"] is False


def test_yaml_then_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("max-num-seqs: 8\nenable_prefix_caching: false\nserved_model_name: [x, y]\nport: 9\n"
                 "api_key: secret\nreasoning_parser: deepseek_r1\n")
    ns = parse_with_config(_serve_parser(), ["--config", str(f), "--port", "10", "--enable-prefix-caching"])
    assert ns.max_num_seqs == 8 and ns.port == 10 and ns.enable_prefix_caching and ns.served_model_name == ["x", "y"]
    assert ns.api_key == "secret" and ns.reasoning_parser == "deepseek_r1"


@pytest.mark.parametrize("text", ["nonsense_key: 1\n", "max_num_seqs: many\n", "enable_prefix_caching: 3\n",
                                  "- a list\n", "reasoning_parser: nope\n"])
def test_bad_yaml(tmp_path, text):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(SystemExit):
        parse_with_config(_serve_parser(), ["--config", str(f)])


def test_example_configs_parse():
    files = sorted(glob.glob(os.path.join(ROOT, "configs", "serve-*.yaml")))
    assert files
    for f in files:
        parse_with_config(_serve_parser(), ["--config", f])


def test_convert_missing_module(monkeypatch, capsys):
    import importlib

    real = importlib.import_module

    def fake(name, *a, **k):
        if name == "deepinfer_jax.weights.convert":
            raise ModuleNotFoundError("No module named 'deepinfer_jax.weights.convert'", name=name)
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake)
    assert main(["convert", "--help"]) == 2
    assert "not available" in capsys.readouterr().err


def test_default_model_is_packaged():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, name))
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(DEFAULT_MODEL_DIR, "*")))
    assert size < 8 * 2**20
