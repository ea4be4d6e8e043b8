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
    (d / "syntax.yaml").write_text("max_num_seqs: [1\n")
    (d / "unknown.yaml").write_text("nonsense_key: 1\n")
    (d / "negative.yaml").write_text("max_num_seqs: -3\n")
    (d / "list.yaml").write_text("- a\n")
    # A model directory whose weights are missing: found only when the engine loads them.
    (d / "noweights").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEFAULT_MODEL_DIR, name), d / "noweights" / name)
    return d


# (argv, what the one line must name); {d} is the fixture's directory
USAGE_ERRORS = [
    (["serve", "--model", "/no/such/dir"], "argument --model: '/no/such/dir' does not exist"),
    (["serve", "--model", "{d}/empty"], "argument --model: .*no config.json"),
    (["serve", "--model", "{d}/gemma"], "argument --model: .*model_type 'gemma' is not supported"),
    (["serve", "--model", "{d}/badjson"], "argument --model: .*not valid JSON"),
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
]


@pytest.mark.parametrize("argv, named", USAGE_ERRORS, ids=[" ".join(a)[:60] for a, _ in USAGE_ERRORS])
def test_usage_error_is_one_line(dirs, argv, named):
    import re

    argv = [a.replace("{d}", str(dirs)) for a in argv]
    r = _run(*argv)
    err = r.stderr.strip()
    cmd = " ".join(["deepinfer"] + [a for a in argv[:2] if a in ("serve", "chat", "generate", "bench", "convert",
                                                                  "offline")])
    assert r.returncode == 2, (r.returncode, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"{cmd}: error: "), err
    assert re.search(named.replace("{d}", re.escape(str(dirs))), err), err
    assert r.stdout == ""
    assert not os.path.exists(dirs / "out")


@pytest.mark.parametrize("cmd", ["generate", "chat"])
def test_engine_build_error_is_one_line(dirs, cmd):
    """Bad input only the load finds (no weights beside config.json and the tokenizer): one line, exit status 1."""
    r = _run(cmd, "--model", str(dirs / "noweights"), *(["--prompt", "x"] if cmd == "generate" else []))
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last == f"deepinfer {cmd}: error: {dirs / 'noweights'} holds no *.safetensors files", r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_serve_engine_error_is_one_line(dirs):
    r = _run("serve", "--model", str(dirs / "noweights"), "--port", "0")
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and errors[0].endswith("the engine failed to start: "
                                                   f"{dirs / 'noweights'} holds no *.safetensors files"), r.stderr
    assert "Traceback" not in r.stderr
