"""The rooms of ARCHITECTURE.md: imports go one way, and the JAX-free rooms stay JAX-free.

Walks every module's import statements (ast, nothing is imported) and fails on an edge the table
below does not allow, naming the file and the import.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "deepinfer_jax")
PKG = "deepinfer_jax"

# room -> rooms it may import (besides itself). Rooms are first path components under deepinfer_jax.
ALLOWED = {
    "xla_env": set(),
    "config": set(),
    "types": set(),
    "text": {"config", "types"},
    "scheduler": {"config", "types"},
    "sampling": set(),
    "kernels": set(),
    "models": {"config", "kernels"},
    "sharding": {"config", "models"},
    "weights": {"config", "models", "sharding"},
    "runner": {"config", "types", "models", "kernels", "sampling", "weights", "sharding"},
    "engine": {"config", "types", "text", "scheduler", "runner", "models", "kernels", "sampling", "weights",
               "sharding"},
    "server": {"config", "types", "text", "engine"},
    "cli": {"config", "types", "text", "engine", "server", "weights"},
    "__init__": {"engine", "types", "xla_env"},
}
NO_JAX = {"xla_env", "config", "types", "text", "scheduler"}
NO_JAX_FILES = {os.path.join("server", "protocol.py")}


def _modules():
    for dirpath, _, files in os.walk(ROOT, followlinks=True):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, ROOT), path


def _room(rel: str) -> str:
    first = rel.split(os.sep)[0]
    return first[:-3] if first.endswith(".py") else first


def _imports(path: str) -> list[str]:
    tree = ast.parse(open(path).read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside the same room
                continue
            out.append(node.module or "")
    return out


def test_rooms_are_known():
    rooms = {_room(rel) for rel, _ in _modules()}
    assert rooms <= set(ALLOWED), f"rooms without an import rule: {rooms - set(ALLOWED)}"


@pytest.mark.parametrize("rel, path", sorted(_modules()))
def test_imports_go_one_way(rel, path):
    room = _room(rel)
    for name in _imports(path):
        if name == PKG or name.startswith(PKG + "."):
            target = name.split(".")[1] if "." in name else "__init__"
            ok = target in (room, "__init__") or target in ALLOWED[room]  # the lazy package root is fine anywhere
            assert ok, f"{rel} imports {name}: {room} may not import {target}"
        if room in NO_JAX or rel in NO_JAX_FILES:
            assert not (name == "jax" or name.startswith("jax.") or name == "flax"), f"{rel} imports {name}"
