"""Live-server fixtures: one real server (real HTTP on 127.0.0.1, a free port) for the whole session,
run in-process on a background thread over the scripted checkpoint (scripted.py), so tests can also
look at engine internals (block usage) and inject faults. A session-wide XLA cache lets the second
engine (test_engine_direct.py) and the CLI subprocesses skip compilation.

Server flags: --max-model-len 512 --max-num-seqs 16 --max-num-batched-tokens 64 --page-size 8
--max-queue-len 64 --api-key API_KEY --reasoning-parser deepseek_r1 --tool-call-parser deepseek_v3
--enable-auto-tool-choice --max-payload-size 1 MiB.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_helpers import API_KEY, SERVER_FLAGS, ServerThread  # noqa: E402


@pytest.fixture(scope="session")
def xla_cache_dir(_session_cache_dir):
    """The session's cache directory (tests/conftest.py), also $DEEPINFER_CACHE_DIR for subprocesses."""
    return _session_cache_dir


@pytest.fixture(scope="session")
def scripted_model(tmp_path_factory):
    """(model dir, {script token string: id})."""
    from scripted import build_scripted_model

    d = str(tmp_path_factory.mktemp("scripted-model"))
    return d, build_scripted_model(d)


@pytest.fixture(scope="session")
def server(scripted_model, xla_cache_dir):
    model_dir, _ = scripted_model
    st = ServerThread(["--model", model_dir, "--port", "0", *SERVER_FLAGS]).start()
    yield st
    st.stop()


@pytest.fixture(scope="session")
def tokenizer(scripted_model):
    from deepinfer_jax.text import load_tokenizer

    return load_tokenizer(scripted_model[0])


@pytest.fixture
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def auth():
    return {"Authorization": f"Bearer {API_KEY}"}
