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
    "config": {"config_common", "config_engine", "config_speculative", "config_v4"},
    "config_common": set(),
    "config_engine": set(),
    "config_speculative": set(),
    "config_v4": {"config_common"},
    "types": set(),
    "text": {"config", "types"},
    "scheduler": {"config", "config_v4", "types"},
    "sampling": set(),
    "kernels": set(),
    "models": {"config", "config_v4", "kernels"},
    "sharding": {"config", "models"},
    "weights": {"config", "config_v4", "models", "sharding"},
    "runner": {"config", "config_v4", "types", "models", "kernels", "sampling", "weights", "sharding", "xla_env"},
    "engine": {"config", "config_v4", "types", "text", "scheduler", "runner", "models", "kernels", "sampling", "weights",
               "sharding", "xla_env"},
    "server": {"config", "types", "text", "engine", "xla_env"},
    "cli": {"config", "types", "text", "engine", "server", "weights"},
    "__init__": {"engine", "types", "xla_env"},
}
NO_JAX = {"xla_env", "config", "config_common", "config_engine", "config_speculative", "config_v4", "types", "text", "scheduler"}
NO_JAX_FILES = {os.path.join("server", f) for f in ("protocol.py", "protocol_output.py", "protocol_structured.py")}


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


# ---- module graph: private names, cycles, file sizes ------------------------------------------------------------
REPO = os.path.normpath(os.path.join(ROOT, ".."))
MAX_LINES = 500
MAX_LINES_MODEL = 1000  # deepinfer_jax/models/*.py: a model file holds a whole architecture


def _module_files() -> dict[str, str]:
    """Dotted module name -> path, for every module of deepinfer_jax (kernels included, through its symlink)."""
    out = {}
    for rel, path in _modules():
        parts = rel[:-3].split(os.sep)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([PKG, *parts])] = path
    return out


MODULES = _module_files()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _resolve(module: str) -> str:
    """The module of ours that `module` (a dotted name of ours) lives in: itself, or the nearest package above."""
    while module not in MODULES:
        module = module.rpartition(".")[0]
    return module


def _absolute(node: ast.ImportFrom, module: str, path: str) -> str:
    """The absolute dotted name an ImportFrom reads from (relative imports resolved against `module`)."""
    if not node.level:
        return node.module or ""
    package = module if os.path.basename(path) == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _ours(name: str) -> bool:
    return name == PKG or name.startswith(PKG + ".")


def _import_edges(module: str, path: str) -> tuple[set[str], list[str], dict[str, str]]:
    """(the modules of ours that `module` imports anywhere in its file, its imports of private names as text,
    local name -> module of ours for the names it binds to our modules)."""
    tree = ast.parse(open(path).read())
    edges, private, bound = set(), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _ours(a.name):
                    edges.add(_resolve(a.name))
                    if a.asname:
                        bound[a.asname] = a.name
                    else:  # `import deepinfer_jax.x.y` binds deepinfer_jax
                        bound[PKG] = PKG
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path)
            if not _ours(source):
                continue
            for a in node.names:
                full = f"{source}.{a.name}"
                if full in MODULES:  # a module
                    edges.add(full)
                    bound[a.asname or a.name] = full
                else:
                    edges.add(_resolve(source))
                    if _is_private(a.name):
                        private.append(f"from {source} import {a.name}")
    return edges - {module}, private, bound


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` of an attribute chain of names, or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _private_attributes(module: str, path: str, bound: dict[str, str]) -> list[str]:
    """`mod._name` where `mod` is a module of ours other than `module`, reached through a name the imports bound."""
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        chain = _dotted(node.value)
        if chain is None or chain.split(".")[0] not in bound:
            continue
        head, _, rest = chain.partition(".")
        target = bound[head] + (f".{rest}" if rest else "")
        if target in MODULES and target != module:
            out.append(f"{chain}.{node.attr}")
    return out


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_another_modules_private_names(module):
    """A name with a leading underscore belongs to its module: no `from x import _y`, no `x._y` on a module of
    ours. What another module needs is public, named without the underscore."""
    path = MODULES[module]
    _, private, bound = _import_edges(module, path)
    private += _private_attributes(module, path, bound)
    assert not private, f"{module} reaches into private names: {private}"


def test_no_import_cycles():
    """The module graph of deepinfer_jax (every import statement of a file, those inside functions included: a
    deferred import still ties the two modules together) has no cycle."""
    graph = {m: _import_edges(m, p)[0] for m, p in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def _sources():
    seen = set()
    for top in ("deepinfer_jax", "kernels", "tools", "benchmarks"):
        for dirpath, _, files in os.walk(os.path.join(REPO, top), followlinks=True):
            for f in files:
                path = os.path.join(dirpath, f)
                if f.endswith(".py") and os.path.realpath(path) not in seen:
                    seen.add(os.path.realpath(path))
                    yield os.path.relpath(path, REPO)


@pytest.mark.parametrize("rel", sorted(_sources()))
def test_files_stay_small(rel):
    """Files under ~500 lines, a model file under ~1,000 (ARCHITECTURE.md's house rules)."""
    limit = MAX_LINES_MODEL if os.path.dirname(rel) == os.path.join("deepinfer_jax", "models") else MAX_LINES
    with open(os.path.join(REPO, rel)) as f:
        n = sum(1 for _ in f)
    assert n < limit, f"{rel} has {n} lines (limit {limit})"
