"""The sharding tests' subprocesses: a script run with the repository on its path and JAX on the CPU (its fake
device count set by the script itself, before JAX starts), whose one line `RESULT <json>` on stdout is its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 900


def env(**extra: str) -> dict:
    """The environment of a run: this one's, JAX on the CPU, the repository importable, plus `extra`."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, **extra}


def start(args: list[str], **extra_env: str) -> subprocess.Popen:
    """Start `python ARGS...` (a script path or `-c CODE`, then its arguments) in `env(**extra_env)`."""
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(**extra_env))


def result(p: subprocess.Popen, timeout: float = TIMEOUT_S) -> dict:
    """A started run's RESULT (asserting it exited 0 and printed one; its stderr's tail otherwise)."""
    stdout, stderr = p.communicate(timeout=timeout)
    assert p.returncode == 0 and "RESULT " in stdout, stderr[-4000:]
    return json.loads(stdout.split("RESULT ", 1)[1])


def run(args: list[str], **extra_env: str) -> dict:
    """One run, to its RESULT."""
    return result(start(args, **extra_env))


def run_all(runs: dict[str, list[str]], **extra_env: str) -> dict[str, dict]:
    """Several runs at once (name -> args), each to its RESULT."""
    procs = {name: start(args, **extra_env) for name, args in runs.items()}
    return {name: result(p) for name, p in procs.items()}
