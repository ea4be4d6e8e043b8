"""CLI flags, the YAML config (flags override it), the example configs, and `deepinfer convert`."""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil

import pytest

from deepinfer_jax.cli import _serve_parser, main
from deepinfer_jax.server.args import DEFAULT_MODEL_DIR, engine_kwargs, parse_with_config, resolve_model

def _default_millions() -> str:
    """The embedded model's parameter count as the notes print it (whichever model ships)."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.engine.serving_defaults import num_params

    return f"{num_params(ModelConfig.from_hf_dict(json.load(open(os.path.join(DEFAULT_MODEL_DIR, 'config.json'))))) / 1e6:.1f}"


DEFAULT_M = _default_millions()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A copy of the embedded model's config.json elsewhere (as a converted copy of it would be), and a large model's
    (DeepSeek-V2-Lite's) config.json: engine_kwargs reads only config.json."""
    d = tmp_path_factory.mktemp("models")
    (d / "copy").mkdir()
    shutil.copy(os.path.join(DEFAULT_MODEL_DIR, "config.json"), d / "copy" / "config.json")
    (d / "large").mkdir()
    shutil.copy(os.path.join(ROOT, "configs", "models", "deepseek-v2-lite.json"), d / "large" / "config.json")
    return str(d / "copy"), str(d / "large")


def _kw(argv, platform="gpu"):
    return engine_kwargs(parse_with_config(_serve_parser(), argv), platform=platform)


def test_defaults_and_vllm_names(model_dirs):
    copy, large = model_dirs
    ns = parse_with_config(_serve_parser(), [])
    assert (ns.host, ns.port, ns.enable_prefix_caching, ns.page_size) == ("127.0.0.1", 8000, True, 64)
    assert resolve_model(ns) == (DEFAULT_MODEL_DIR, "deepinfer-default")
    # small models (the embedded one, or a copy of it) get small sizes unless flags say otherwise; a large one LLM's
    for argv in ([], ["--model", copy]):
        kw, note = _kw(argv)
        assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["max_model_len"]) == (32, 256, 2048)
        assert not {"token_buckets", "greedy_variant", "warmup_runs"} & set(kw)  # on a GPU the programs are LLM's
        assert note == (f"engine defaults for a small model ({DEFAULT_M}M parameters) on gpu: max_num_seqs 32, "
                        "max_num_batched_tokens 256, max_model_len 2048 (few step programs to compile at start)")
    kw, _ = _kw(["--max-num-seqs", "4"])
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"]) == (4, 256)
    kw, note = _kw(["--model", large])
    assert not {"max_num_seqs", "max_num_batched_tokens", "max_model_len", "token_buckets"} & set(kw) and note == ""
    ns = parse_with_config(_serve_parser(), ["--block-size", "16", "--no-enable-prefix-caching", "-tp", "1",
                                             "--served-model-name", "a", "b", "--model", large])
    assert ns.page_size == 16 and not ns.enable_prefix_caching and ns.served_model_name == ["a", "b"]
    kw, _ = engine_kwargs(ns, platform="gpu")
    assert kw["page_size"] == 16 and kw["enable_prefix_caching"] is False and "attn_impl" not in kw
    assert "unroll_max_tokens" not in kw  # the engine's default (256 on a GPU)
    kw, _ = _kw(["--model", large, "--unroll-max-tokens", "0"])
    assert kw["unroll_max_tokens"] == 0 and "prefill_layers" not in kw
    kw, _ = _kw(["--model", large, "--prefill-layers", "indexed"])
    assert kw["prefill_layers"] == "indexed"
    assert "prefill_context_variant" not in kw  # LLM's default (on)
    kw, _ = _kw(["--model", large, "--prefill-context-variant"])
    assert kw["prefill_context_variant"] is True
    kw, _ = _kw(["--model", large, "--no-prefill-context-variant"])
    assert kw["prefill_context_variant"] is False and "greedy_variant" not in kw
    kw, _ = _kw(["--model", large, "--no-greedy-variant"])
    assert kw["greedy_variant"] is False


def test_large_gpu_server_step_budget(model_dirs):
    """On a GPU of 70+ GiB a large model's server takes 8,192 tokens a step (vLLM's API server there); smaller GPUs,
    small models and a set flag keep theirs."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.engine.serving_defaults import large_gpu_total, serving_defaults

    assert large_gpu_total() is None  # this CPU machine
    copy, large = model_dirs
    big, small = (ModelConfig.from_model_dir(d) for d in (large, copy))
    out, note = serving_defaults(big, "gpu", {}, 80 * 2**30)
    assert out == {"max_num_batched_tokens": 8192}
    assert note.endswith("on gpu: max_num_batched_tokens 8192 (a GPU of 80 GiB: vLLM's server budget there)")
    assert serving_defaults(big, "gpu", {"max_num_seqs": 1024}, 141 * 2**30)[0] == {"max_num_batched_tokens": 8192}
    assert serving_defaults(big, "gpu", {"max_num_batched_tokens": 2048}, 80 * 2**30) == ({}, "")
    assert serving_defaults(big, "gpu", {}, 24 * 2**30) == ({}, "")
    assert serving_defaults(big, "gpu", {}, None) == ({}, "")
    assert serving_defaults(small, "gpu", {}, 80 * 2**30)[0]["max_num_batched_tokens"] == 256


def test_cpu_defaults_by_model_size(model_dirs):
    """On a CPU a small model, embedded or not, also gets fewer step programs: two token buckets (a decode one
    holding every sequence row, then the step's budget) and no greedy sampling variant; flags still win. Every model
    runs each step program once at warm-up there (no CUDA graph to record)."""
    copy, large = model_dirs
    for argv in ([], ["--model", copy]):
        kw, note = _kw(argv, "cpu")
        assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["max_model_len"]) == (16, 256, 2048)
        assert kw["token_buckets"] == (16, 256) and kw["greedy_variant"] is False and kw["warmup_runs"] == 1
        assert note == (f"engine defaults for a small model ({DEFAULT_M}M parameters) on cpu: max_num_seqs 16, "
                        "max_num_batched_tokens 256, max_model_len 2048, token buckets (16, 256) (not (16, 32, 64, "
                        "128, 256)), no greedy sampling variant, one warm-up run a step program (few step programs "
                        "to compile at start, seconds each on a CPU, while a step padded to a larger bucket costs "
                        "such a model little; no CUDA graph to record on a CPU)")
    kw, note = _kw(["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "1024",
                    "--greedy-variant"], "cpu")
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["max_model_len"]) == (8, 64, 1024)
    assert kw["token_buckets"] == (16, 64) and kw["greedy_variant"] is True
    assert note.startswith(f"engine defaults for a small model ({DEFAULT_M}M parameters) on cpu: token buckets (16, 64) (not "
                           "(16, 32, 64)), one warm-up run a step program (")
    kw, _ = _kw(["--max-num-batched-tokens", "4096"], "cpu")
    assert kw["token_buckets"] == (16, 256, 4096)  # each 16x the last: a short prompt pads 16x at most
    kw, _ = _kw(["--max-num-seqs", "32"], "cpu")
    assert (kw["max_num_batched_tokens"], kw["token_buckets"]) == (256, (32, 256))
    kw, note = _kw(["--model", large], "cpu")
    assert not {"max_num_seqs", "token_buckets", "greedy_variant"} & set(kw) and kw["warmup_runs"] == 1
    assert note == ("engine defaults for a model of 15,706M parameters on cpu: one warm-up run a step program (no CUDA "
                    "graph to record on a CPU)")


def test_coarse_token_buckets():
    from deepinfer_jax.runner.inputs import coarse_token_buckets, token_buckets

    assert coarse_token_buckets(256, 16) == (16, 256) and token_buckets(256, 16) == (16, 32, 64, 128, 256)
    assert coarse_token_buckets(256, 32) == (32, 256) and coarse_token_buckets(64, 8) == (16, 64)
    assert coarse_token_buckets(2048, 256) == (256, 2048) and coarse_token_buckets(8192, 16) == (16, 256, 4096, 8192)
    assert coarse_token_buckets(4096, 32, factor=4) == (32, 128, 512, 2048, 4096)
    assert coarse_token_buckets(8, 4) == token_buckets(8, 4) == (8,)
    assert coarse_token_buckets(100, 300) == (512,)  # the top holds max(tokens, sequences)


def test_kv_offloading_size(model_dirs, tmp_path, capsys):
    _, large = model_dirs
    assert _kw(["--model", large])[0]["kv_offloading_size"] == 0.0
    assert _kw(["--model", large, "--kv-offloading-size", "2.5"])[0]["kv_offloading_size"] == 2.5
    f = tmp_path / "c.yaml"
    f.write_text(f"model: {large}\nkv_offloading_size: 4\n")
    assert _kw(["--config", str(f)])[0]["kv_offloading_size"] == 4.0
    with pytest.raises(SystemExit):
        _kw(["--model", large, "--kv-offloading-size", "-1"])
    assert "--kv-offloading-size" in capsys.readouterr().err


def test_yaml_then_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("max-num-seqs: 8\nenable_prefix_caching: false\nserved_model_name: [x, y]\nport: 9\n"
                 "api_key: secret\nreasoning_parser: deepseek_r1\n")
    ns = parse_with_config(_serve_parser(), ["--config", str(f), "--port", "10", "--enable-prefix-caching"])
    assert ns.max_num_seqs == 8 and ns.port == 10 and ns.enable_prefix_caching and ns.served_model_name == ["x", "y"]
    assert ns.api_key == ["secret"] and ns.reasoning_parser == "deepseek_r1"
    g = tmp_path / "d.yaml"  # several files: each read, in turn (the later wins), the command line over all
    g.write_text("max_num_seqs: 4\nport: 11\n")
    ns = parse_with_config(_serve_parser(), ["--config", str(f), "--config", str(g), "--port", "12"])
    assert (ns.max_num_seqs, ns.port, ns.api_key) == (4, 12, ["secret"])


def test_speculative_config_flag_and_yaml(tmp_path):
    ns = parse_with_config(_serve_parser(), ["--speculative-config",
                                             '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'])
    spec = engine_kwargs(ns, platform="gpu")[0]["speculative_config"]
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 3, 4, 4)
    f = tmp_path / "c.yaml"
    f.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 2\n")
    assert parse_with_config(_serve_parser(), ["--config", str(f)]).speculative_config.num_speculative_tokens == 2
    assert parse_with_config(_serve_parser(), []).speculative_config is None
    f.write_text(f"speculative_config:\n  method: draft_model\n  model: {tmp_path}\n  num_speculative_tokens: 4\n")
    spec = parse_with_config(_serve_parser(), ["--config", str(f)]).speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", str(tmp_path), 4)


@pytest.mark.parametrize("text", ["nonsense_key: 1\n", "max_num_seqs: many\n", "enable_prefix_caching: 3\n",
                                  "- a list\n", "reasoning_parser: nope\n", "port: [1\n", "max_model_len: 0\n",
                                  "host: {a: 1}\n", "speculative_config: {method: ngram, num_speculative_tokens: 0}\n",
                                  "speculative_config: {method: ngram, num_speculative_tokens: 2, k: 1}\n",
                                  "speculative_config: {method: draft_model, model: /nowhere, num_speculative_tokens: 1}\n",
                                  "enable_chunked_prefill: false\n", "max_model_len: 0x800\n", "seed: 12:30\n"])
def test_bad_yaml(tmp_path, capsys, text):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(SystemExit) as e:
        parse_with_config(_serve_parser(), ["--config", str(f)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("deepinfer serve: error: ")


def test_example_configs_parse():
    files = sorted(glob.glob(os.path.join(ROOT, "configs", "serve-*.yaml")))
    assert files
    for f in files:
        parse_with_config(_serve_parser(), ["--config", f])


# each shipped serve config -> the shipped model config of the model it names (None: the embedded model)
SERVE_CONFIG_MODELS = {"serve-deepseek-r1.yaml": "deepseek-v3.json", "serve-deepseek-v2-lite.yaml":
                       "deepseek-v2-lite.json", "serve-default.yaml": None}


def test_shipped_configs_validate(tmp_path):
    """Every file under configs/ passes the start-up checks: each model config is a model this engine serves, and
    each serve config, its `model` replaced by a directory holding its model's config.json (a positional MODEL wins
    over the file's), passes check_engine_args with its own --max-model-len and parallel sizes."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.server.args import check_engine_args

    dirs = {}
    for f in sorted(glob.glob(os.path.join(ROOT, "configs", "models", "*.json"))):
        d = tmp_path / os.path.basename(f)
        d.mkdir()
        shutil.copy(f, d / "config.json")
        ModelConfig.from_model_dir(str(d))
        dirs[os.path.basename(f)] = str(d)
    files = {os.path.basename(f) for f in glob.glob(os.path.join(ROOT, "configs", "serve-*.yaml"))}
    assert files == set(SERVE_CONFIG_MODELS)
    for name, model in SERVE_CONFIG_MODELS.items():
        parser = _serve_parser()
        ns = check_engine_args(parser, parse_with_config(parser, ([dirs[model]] if model else [])
                                                         + ["--config", os.path.join(ROOT, "configs", name)]))
        assert resolve_model(ns)[0] == (dirs[model] if model else DEFAULT_MODEL_DIR)
        engine_kwargs(ns, platform="gpu")


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
    assert size < 13 * 2**20


def test_quantization_flag_and_yaml(tmp_path, capsys):
    """--quantization (vLLM's flag, also a YAML key) reaches LLM; a value the model directory cannot serve is a
    one-line usage error at parse time, before anything loads."""
    from deepinfer_jax.server.args import check_engine_args

    f = tmp_path / "c.yaml"
    f.write_text("quantization: fp8\n")
    parser = _serve_parser()
    ns = check_engine_args(parser, parse_with_config(parser, ["--config", str(f)]))
    assert engine_kwargs(ns, platform="gpu")[0]["quantization"] == "fp8"
    assert _kw([])[0]["quantization"] is None  # auto: the checkpoint's own format
    for argv, msg in ((["--quantization", "int8"], "needs a converted checkpoint: deepinfer convert"),
                      (["-q", "fp8", "--load-format", "dummy"], "not supported with --load-format dummy")):
        with pytest.raises(SystemExit) as e:
            check_engine_args(parser, parse_with_config(parser, argv))
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and "argument --quantization: " in err and msg in err


def test_kv_cache_dtype_flag_and_yaml(tmp_path, capsys):
    from deepinfer_jax.server.args import check_engine_args

    f = tmp_path / "c.yaml"
    f.write_text("kv_cache_dtype: fp8\n")
    parser = _serve_parser()
    ns = check_engine_args(parser, parse_with_config(parser, ["--config", str(f)]))
    assert engine_kwargs(ns, platform="gpu")[0]["kv_cache_dtype"] == "fp8"
    assert _kw([])[0]["kv_cache_dtype"] == "auto"
    with pytest.raises(SystemExit) as e:
        check_engine_args(parser, parse_with_config(parser, ["--kv-cache-dtype", "fp8", "--attn-impl", "pallas"]))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "argument --kv-cache-dtype: fp8 runs with" in err


def test_pipeline_parallel_size_flag_and_yaml(model_dirs, tmp_path, capsys):
    """--pipeline-parallel-size / -pp (vLLM's flag, also a YAML key) reaches LLM; 0 is a usage error."""
    _, large = model_dirs
    assert _kw(["--model", large])[0]["pipeline_parallel_size"] == 1
    assert _kw(["--model", large, "-pp", "2"])[0]["pipeline_parallel_size"] == 2
    f = tmp_path / "c.yaml"
    f.write_text(f"model: {large}\npipeline-parallel-size: 4\n")
    assert _kw(["--config", str(f)])[0]["pipeline_parallel_size"] == 4
    with pytest.raises(SystemExit):
        _kw(["--model", large, "--pipeline-parallel-size", "0"])
    assert "--pipeline-parallel-size" in capsys.readouterr().err


def test_cpu_offload_gb(model_dirs, tmp_path, capsys):
    _, large = model_dirs
    assert _kw(["--model", large])[0]["cpu_offload_gb"] == 0.0
    assert _kw(["--model", large, "--cpu-offload-gb", "1.5"])[0]["cpu_offload_gb"] == 1.5
    f = tmp_path / "c.yaml"
    f.write_text(f"model: {large}\ncpu_offload_gb: 3\n")
    assert _kw(["--config", str(f)])[0]["cpu_offload_gb"] == 3.0
    with pytest.raises(SystemExit):
        _kw(["--model", large, "--cpu-offload-gb", "-1"])
    assert "--cpu-offload-gb" in capsys.readouterr().err


def test_vllm_spellings(model_dirs, tmp_path):
    """What a vLLM command line or YAML file says means the same here: flag names with underscores, human-readable
    token counts, vLLM's value names, the YAML keys of our aliases (block_size), and a positional MODEL over the
    file's `model` (the command line wins, as in vLLM)."""
    copy, large = model_dirs
    ns = parse_with_config(_serve_parser(), ["--max_model_len=32k", "--max_num_batched_tokens", "8K", "--dtype",
                                             "half", "--load-format", "safetensors", "--no_enable_prefix_caching",
                                             "--tensor_parallel_size", "2"])
    assert (ns.max_model_len, ns.max_num_batched_tokens, ns.dtype, ns.load_format) == (32000, 8192, "float16", "auto")
    assert ns.enable_prefix_caching is False and ns.tensor_parallel_size == 2
    assert parse_with_config(_serve_parser(), ["--max-model-len", "2.5k", "--dtype", "float"]).max_model_len == 2500
    assert parse_with_config(_serve_parser(), ["--dtype", "float"]).dtype == "float32"
    f = tmp_path / "c.yaml"
    f.write_text(f"model: {large}\nblock_size: 16\nnum-gpu-blocks-override: 40\nmax_model_len: 1k\n")
    ns = parse_with_config(_serve_parser(), ["--config", str(f)])
    assert (ns.model, ns.page_size, ns.num_pages, ns.max_model_len) == (large, 16, 40, 1000)
    from deepinfer_jax.server.args import check_engine_args

    parser = _serve_parser()
    ns = check_engine_args(parser, parse_with_config(parser, [copy, "--config", str(f)]))
    assert resolve_model(ns) == (copy, copy) and ns.page_size == 16
    ns = check_engine_args(parser, parse_with_config(parser, ["--config", str(f), "--model", copy]))
    assert ns.model == copy


def test_api_key_from_vllm_environment(monkeypatch):
    """An operator's VLLM_API_KEY still locks the server (vLLM reads it); DEEPINFER_API_KEY and --api-key win."""
    monkeypatch.delenv("DEEPINFER_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert parse_with_config(_serve_parser(), []).api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert parse_with_config(_serve_parser(), []).api_key == ["from-vllm"]
    assert parse_with_config(_serve_parser(), ["--api-key", "flag"]).api_key == ["flag"]
    monkeypatch.setenv("DEEPINFER_API_KEY", "ours")
    assert parse_with_config(_serve_parser(), []).api_key == ["ours"]


def test_yaml_values_as_written(tmp_path):
    """A YAML value reaches its flag as written, as on a command line: YAML 1.1 would read an unquoted 0123 as 83,
    12:30 as 750 and yes as true. JSON flags take a mapping."""
    f = tmp_path / "c.yaml"
    f.write_text("api_key: 0123\nserved_model_name: [0x1F, yes, 12:30]\nmax_model_len: 1k\nhost: 0.0.0.0\n"
                 "eplb_config: {num_redundant_experts: 2}\ntrust_remote_code: false\nenable_chunked_prefill: true\n")
    ns = parse_with_config(_serve_parser(), ["--config", str(f)])
    assert (ns.api_key, ns.served_model_name, ns.max_model_len, ns.host) == (["0123"], ["0x1F", "yes", "12:30"], 1000,
                                                                               "0.0.0.0")
    assert json.loads(ns.eplb_config) == {"num_redundant_experts": 2} and ns.trust_remote_code is False


def test_uvicorn_log_level_sets_the_http_servers_loggers(capsys):
    """vLLM's --uvicorn-log-level: aiohttp's loggers here (trace is debug); left out, they follow --log-level."""
    from deepinfer_jax.cli import _serve_parser
    from deepinfer_jax.server.app import configure_logging

    parser = _serve_parser()
    http, jax_log = logging.getLogger("aiohttp"), logging.getLogger("jax")
    saved = http.level, jax_log.level
    try:
        configure_logging(parser.parse_args(["--uvicorn-log-level", "trace"]))
        assert http.level == logging.DEBUG
        configure_logging(parser.parse_args(["--uvicorn-log-level", "error"]))
        assert logging.getLogger("aiohttp.server").getEffectiveLevel() == logging.ERROR
    finally:
        http.setLevel(saved[0])
        jax_log.setLevel(saved[1])
    assert parser.parse_args([]).uvicorn_log_level is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--uvicorn-log-level", "loud"])
    assert "argument --uvicorn-log-level: invalid choice: 'loud'" in capsys.readouterr().err
