"""Every usage error of the `deepinfer` command is one line on stderr, `deepinfer CMD: error: ...` naming the flag,
exit status 2, found while parsing (no engine is built: each run takes about a second); bad input found while the
engine is built is one line too (exit status 1), without a traceback. Subprocesses, as a user runs the command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from deepinfer_jax.server.args import DEFAULT_MODEL_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("DEEPINFER_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "deepinfer_jax.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Model directories that are not servable, and YAML configs that are not valid."""
    d = tmp_path_factory.mktemp("cli")
    (d / "empty").mkdir()
    (d / "gemma").mkdir()
    (d / "gemma" / "config.json").write_text(json.dumps({"model_type": "gemma"}))
    (d / "badjson").mkdir()
    (d / "badjson" / "config.json").write_text("{not json")
    (d / "listjson").mkdir()
    (d / "listjson" / "config.json").write_text("[1, 2]")
    (d / "badfield").mkdir()
    (d / "badfield" / "config.json").write_text(json.dumps({**json.load(open(os.path.join(DEFAULT_MODEL_DIR,
                                                                                           "config.json"))),
                                                            "hidden_size": "big"}))
    (d / "syntax.yaml").write_text("max_num_seqs: [1\n")
    (d / "unknown.yaml").write_text("nonsense_key: 1\n")
    (d / "negative.yaml").write_text("max_num_seqs: -3\n")
    (d / "list.yaml").write_text("- a\n")
    # A model directory whose weights are missing: found only when the engine loads them.
    (d / "noweights").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEFAULT_MODEL_DIR, name), d / "noweights" / name)
    # A classifier head on a supported model_type, a safetensors file cut short, a shard index that is not JSON.
    (d / "classifier").mkdir()
    config = json.load(open(os.path.join(DEFAULT_MODEL_DIR, "config.json")))
    (d / "classifier" / "config.json").write_text(json.dumps({**config,
                                                             "architectures": ["DeepseekV3ForSequenceClassification"]}))
    shutil.copytree(d / "noweights", d / "truncated")
    with open(os.path.join(DEFAULT_MODEL_DIR, "model.safetensors"), "rb") as f:
        (d / "truncated" / "model.safetensors").write_bytes(f.read(1 << 20))
    shutil.copytree(d / "noweights", d / "badtokenizer")  # a tokenizer.json or tokenizer_config.json cut short
    (d / "badtokenizer" / "tokenizer.json").write_text('{"model": ')
    shutil.copytree(d / "noweights", d / "badtokconfig")
    (d / "badtokconfig" / "tokenizer_config.json").write_text("{bad")
    shutil.copytree(d / "noweights", d / "badindex")
    # The model's own chat template does not compile (the weights are there: `generate` reaches LLM's tokenizer).
    shutil.copytree(d / "truncated", d / "badtemplate")
    shutil.copy(os.path.join(DEFAULT_MODEL_DIR, "model.safetensors"), d / "badtemplate" / "model.safetensors")
    tc = json.load(open(os.path.join(DEFAULT_MODEL_DIR, "tokenizer_config.json")))
    (d / "badtemplate" / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": "{% if %}"}))
    (d / "badindex" / "model.safetensors.index.json").write_text('{"weight_map": ')
    return d


# (argv, what the one line must name); {d} is the fixture's directory
USAGE_ERRORS = [
    (["serve", "--model", "/no/such/dir"], "argument --model: '/no/such/dir' does not exist"),
    (["serve", "--model", "{d}/empty"], "argument --model: .*no config.json"),
    (["serve", "--model", "{d}/gemma"], "argument --model: .*model_type 'gemma' is not supported"),
    (["serve", "--model", "{d}/badjson"], "argument --model: .*not valid JSON"),
    (["serve", "--model", "{d}/listjson"], "argument --model: .*config.json must hold a JSON object, not a list"),
    (["plan", "--model", "{d}/badfield"], "argument --model: .*config.json: a field of the wrong type \\(ValueError: "
                                          "invalid literal for int\\(\\) with base 10: 'big'\\)"),
    (["generate", "--model", "/no/such/dir", "--prompt", "x"], "argument --model"),
    (["chat", "--model", "{d}/empty"], "argument --model"),
    (["serve", "--max-model-len", "-5"], "argument --max-model-len: must be a positive integer, got -5"),
    (["serve", "--max-model-len", "999999"], "argument --max-model-len: 999999 exceeds the model's max_position"),
    (["generate", "--prompt", "x", "--max-num-seqs", "0"], "argument --max-num-seqs"),
    (["chat", "--max-num-batched-tokens", "-1"], "argument --max-num-batched-tokens"),
    (["serve", "--max-num-seqs", "many"], "argument --max-num-seqs: must be a positive integer, got 'many'"),
    (["serve", "--port", "70000"], "argument --port"),
    (["serve", "--port", "-1"], "argument --port"),
    (["serve", "--gpu-memory-utilization", "0"], "argument --gpu-memory-utilization"),
    (["serve", "--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization"),
    (["serve", "--tensor-parallel-size", "0"], "argument --tensor-parallel-size"),
    (["generate", "--prompt", "x", "-dp", "0"], "argument --data-parallel-size"),
    (["serve", "--page-size", "48"], "argument --page-size"),
    (["serve", "--num-pages", "1"], "argument --num-pages"),
    (["serve", "--unroll-max-tokens", "-1"], "argument --unroll-max-tokens"),
    (["serve", "--max-queue-len", "-1"], "argument --max-queue-len"),
    (["serve", "--shutdown-timeout", "-1"], "argument --shutdown-timeout"),
    (["serve", "--attn-impl", "magic"], "argument --attn-impl: invalid choice"),
    (["serve", "--dtype", "int3"], "argument --dtype: invalid choice"),
    (["serve", "--nonsense"], "unrecognized arguments: --nonsense"),
    (["serve", "--config", "{d}/nope.yaml"], "argument --config: .*nope.yaml"),
    (["serve", "--config", "{d}/syntax.yaml"], "argument --config: .*not valid YAML"),
    (["serve", "--config", "{d}/unknown.yaml"], "argument --config: .*unknown key 'nonsense_key'"),
    (["serve", "--config", "{d}/list.yaml"], "argument --config: .*mapping"),
    (["serve", "--config", "{d}/negative.yaml"], "argument --max-num-seqs: must be a positive integer"),
    (["serve", "--config"], "argument --config: expected one argument"),
    (["generate"], "the following arguments are required: --prompt"),
    (["generate", "--prompt", "x", "--max-tokens", "0"], "argument --max-tokens"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "argument --temperature"),
    (["chat", "--top-p", "2"], "argument --top-p"),
    (["bench", "serve", "--max-concurrency", "1,x"], "argument --max-concurrency"),
    (["bench", "serve", "--input-len", "0"], "argument --input-len"),
    (["bench", "serve", "--base-url", "localhost:8000"], "argument --base-url"),
    (["bench", "serve", "--request-rate", "0"], "argument --request-rate"),
    (["bench", "offline", "--batch", "0"], "argument --batch"),
    (["bench", "offline", "--preset", "nope"], "argument --preset: invalid choice"),
    (["bench", "offline", "--temperatures", "0,hot"], "argument --temperatures"),
    (["bench", "nope"], "unknown benchmark 'nope'"),
    (["convert", "--src", "/no/such/dir", "--dst", "{d}/out"], "argument --src: '/no/such/dir' does not exist"),
    (["convert", "--src", "{d}/empty", "--dst", "{d}/out"], "argument --src: .*no config.json"),
    (["convert", "--src", DEFAULT_MODEL_DIR, "--dst", "{d}/out", "--group-size", "0"], "argument --group-size"),
    (["convert"], "the following arguments are required: --src, --dst"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    # vLLM's spellings: underscores read as dashes, the nearest flag suggested, the dotted JSON form refused by name
    (["serve", "--max_model_len", "999999"], "argument --max-model-len: 999999 exceeds the model's max_position"),
    (["serve", "--max-model-length", "100"], r"unrecognized arguments: --max-model-length \(did you mean "
                                             r"--max-model-len\?\)$"),
    (["serve", "--speculative-config.method", "ngram"], "--speculative-config.KEY VALUE, vLLM's dotted form, is not "
                                                        "supported: pass --speculative-config as one JSON value"),
    (["serve", "--max-model-len", "auto"], "argument --max-model-len: auto .* is not supported"),
    (["serve", "--max-model-len", "1.5K"], "argument --max-model-len: must be a whole number before K"),
    (["serve", "--seed", "-1"], "argument --seed: must be an integer in 0..2"),
    (["serve", "--max-num-seqs", "64", "--max-num-batched-tokens", "32"], "argument --max-num-batched-tokens: 32 is "
                                                                          "less than --max-num-seqs 64"),
    (["serve", "--served-model-name", "name", "{d}/noweights"],
     "argument --served-model-name: '{d}/noweights' is a model directory: give it first"),
    (["serve", "--api-key", "key", "{d}/noweights"],
     "argument --api-key: '{d}/noweights' is a model directory: give it first"),
    (["serve", "--generation-config", "{d}"], "argument --generation-config: generation config '.*' is not "
                                              "a folder holding a generation_config.json"),
    (["serve", "deepseek-ai/DeepSeek-V2-Lite"], "argument --model: 'deepseek-ai/DeepSeek-V2-Lite' does not exist "
                                                r"\(models are local directories: `huggingface-cli download REPO"),
    (["serve", "--model", "{d}/classifier"], "argument --model: .*'DeepseekV3ForSequenceClassification' is not a "
                                             "causal LM"),
    (["plan"], "the following arguments are required: --model"),
    (["plan", "--model", "/no/such/dir"], "argument --model: '/no/such/dir' does not exist"),
    (["plan", "--model", "{d}/gemma"], "argument --model: .*model_type 'gemma' is not supported"),
    (["plan", "--model", DEFAULT_MODEL_DIR, "-tp", "0"], "argument --tensor-parallel-size/-tp: must be a positive"),
    (["plan", "--model", DEFAULT_MODEL_DIR, "--gpu-memory", "0"], "argument --gpu-memory: must be a positive"),
    (["plan", "--model", DEFAULT_MODEL_DIR, "--gpu-memory-utilization", "2"], "argument --gpu-memory-utilization"),
    (["plan", "--model", DEFAULT_MODEL_DIR, "--page-size", "48"], "argument --page-size"),
    (["plan", "--model", DEFAULT_MODEL_DIR, "--max-model-len", "9999999"], "argument --max-model-len: 9999999 exceeds"),
    (["plan", "--model", "{d}/truncated"], "{d}/truncated/model.safetensors is truncated: its header needs"),
    (["plan", "--model", "{d}/badindex"], "{d}/badindex/model.safetensors.index.json is not a safetensors index"),
]


@pytest.mark.parametrize("argv, named", USAGE_ERRORS, ids=[" ".join(a)[:60] for a, _ in USAGE_ERRORS])
def test_usage_error_is_one_line(dirs, argv, named):
    import re

    argv = [a.replace("{d}", str(dirs)) for a in argv]
    r = _run(*argv)
    err = r.stderr.strip()
    cmd = " ".join(["deepinfer"] + [a for a in argv[:2] if a in ("serve", "chat", "generate", "bench", "convert",
                                                                  "offline", "plan")])
    assert r.returncode == 2, (r.returncode, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"{cmd}: error: "), err
    assert re.search(named.replace("{d}", re.escape(str(dirs))), err), err
    assert r.stdout == ""
    assert not os.path.exists(dirs / "out")


@pytest.mark.parametrize("cmd, model, extra, error", [
    ("generate", "noweights", [], "{m} holds no *.safetensors files"),
    ("chat", "noweights", [], "{m} holds no *.safetensors files"),
    ("generate", "truncated", [], "{m}/model.safetensors is truncated: its header needs 10097064 bytes, the file has "
                                  "1048576 (an interrupted download or copy?)"),
    ("generate", "noweights", ["--compilation-cache-dir", "{d}/gemma/config.json/xla"],
     "compilation cache directory '{d}/gemma/config.json/xla' (--compilation-cache-dir, $DEEPINFER_CACHE_DIR): Not a "
     "directory; pass a writable directory, or none to turn the cache off"),
    ("generate", "badtemplate", [], "{m}/tokenizer_config.json chat_template: chat template does not compile: Expected "
                                    "an expression, got 'end of statement block'; pass one that compiles with "
                                    "--chat-template")])
def test_engine_build_error_is_one_line(dirs, cmd, model, extra, error):
    """Bad input only the start finds (no weights beside config.json and the tokenizer, a file cut short, a cache
    directory that cannot be made): one line naming the file, exit status 1."""
    assert os.path.getsize(os.path.join(DEFAULT_MODEL_DIR, "model.safetensors")) == 10097064
    extra = [a.replace("{d}", str(dirs)) for a in extra]
    r = _run(cmd, "--model", str(dirs / model), *extra, *(["--prompt", "x"] if cmd == "generate" else []))
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last == f"deepinfer {cmd}: error: " + error.format(m=dirs / model, d=dirs), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_serve_engine_error_is_one_line(dirs):
    r = _run("serve", "--model", str(dirs / "noweights"), "--port", "0")
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and errors[0].endswith("the engine failed to start: "
                                                   f"{dirs / 'noweights'} holds no *.safetensors files"), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("model, extra, error", [
    ("badtokenizer", [], "{d}/badtokenizer/tokenizer.json cannot be read as a tokenizer (EOF while parsing"),
    ("badtokconfig", [], "{d}/badtokconfig/tokenizer_config.json is not valid JSON (Expecting property name"),
    ("noweights", ["--chat-template", "{% if %}"], "--chat-template (user-string): chat template does not compile: "),
    ("badtemplate", [], "{d}/badtemplate/tokenizer_config.json chat_template: chat template does not compile: ")])
def test_serve_tokenizer_error_is_one_line(dirs, model, extra, error):
    """A tokenizer file that cannot be read, or a --chat-template or the model's own template that cannot compile,
    stops serve before the weights load: one line naming the file or the flag, exit status 2."""
    r = _run("serve", "--model", str(dirs / model), "--port", "0", *extra)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "cannot start: " + error.format(d=dirs) in errors[0], r.stderr
    assert "Traceback" not in r.stderr and "loading" not in r.stderr


def test_plan_json_keys_are_documented():
    """`deepinfer plan --json` prints exactly the keys docs/quantization.md's table lists."""
    import re

    r = _run("plan", "--model", DEFAULT_MODEL_DIR, "--json", "--gpu-memory", "1")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    text = open(os.path.join(ROOT, "docs", "quantization.md")).read()
    table = text[text.index("`--json` prints one object"):text.index("Its figures are the engine's")]
    documented = {k for row in table.splitlines() if row.startswith("| `")
                  for k in re.findall(r"`([a-z_0-9]+)`", row.split("|")[1])}
    assert set(got) == documented, set(got) ^ documented
    assert got["fits"] is True and got["kv_tokens_per_rank"] > 0 and got["kv_groups"] == []


def test_setup_script_refuses_unknown_arguments():
    """README's `bash scripts/setup.sh [--test]`: a mistyped option is refused before anything is installed."""
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup.sh"), "--tests"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == ("setup: unknown arguments: --tests (usage: bash "
                                                      "scripts/setup.sh [--test])"), r.stderr


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The embedded model converted (`deepinfer convert`), and copies of it with a data file cut short and with its
    metadata gone."""
    d = tmp_path_factory.mktemp("converted")
    r = _run("convert", "--src", DEFAULT_MODEL_DIR, "--dst", str(d / "ok"))
    assert r.returncode == 0, r.stderr
    state = os.path.join("params", "state")
    shutil.copytree(d / "ok", d / "truncated")
    data = max((os.path.join(root, f) for root, _, files in os.walk(d / "truncated" / state) for f in files),
               key=os.path.getsize)
    os.truncate(data, 1000)
    shutil.copytree(d / "ok", d / "nometa")
    os.remove(d / "nometa" / state / "_METADATA")
    return d


@pytest.mark.parametrize("model, error", [
    ("truncated", r"{m}/params/state: \w+ cannot be read \(ValueError: OUT_OF_RANGE: .* is not valid for value of "
                  r"size 1000\)$"),
    ("nometa", r"{m}/params/state: no readable _METADATA \(missing or corrupt: an incomplete copy\?\)$")])
def test_converted_checkpoint_error_is_one_line(converted, model, error):
    """A converted directory damaged after `deepinfer convert`: one line naming the checkpoint, exit status 1."""
    import re

    r = _run("generate", "--model", str(converted / model), "--prompt", "x", "--max-tokens", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert re.fullmatch("deepinfer generate: error: " + error.format(m=re.escape(str(converted / model))), last), last
