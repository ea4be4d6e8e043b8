"""Server plugins: user code that rewrites or rejects requests and rewrites their output.

A plugin is an object with any of these hooks (subclass `Plugin` for the defaults); each may be a plain
function or a coroutine function:

    on_request(ctx, body) -> dict | None     the decoded JSON body of /v1/chat/completions or /v1/completions,
                                             before it is parsed, templated and tokenized: return a new body
                                             (or change it in place and return None). Raise `Reject(message,
                                             status=400, code=..., param=...)` to refuse the request.
    on_delta(ctx, index, text, final) -> str each output delta of choice `index` (streamed or not), the model's
                                             text before the reasoning and tool-call parsers; return the text to
                                             pass on. A plugin may hold text back (to match across chunk
                                             boundaries) and must return what it holds when `final` is true.
    on_response(ctx, response) -> dict|None  the whole response object of a request that is not streamed.
    routes() -> list[aiohttp RouteDef]       extra routes, added once at start-up (not guarded by --api-key).

`ctx` (`RequestContext`) has the endpoint ("chat.completions" / "completions"), the request id, `stream`,
and `state`, a dict per request and plugin. Hooks run in the order the plugins were loaded.

Where they run: coroutine hooks and plain hooks of a plugin with `blocking = False` (the default) run on the
event loop, so they must be quick; a plugin that does slow work (a model call, a big regex over a long
prompt) sets `blocking = True` and its plain hooks run on the server's text threads (`Serving.offload`).

Failures: `Reject` (or any `APIError`) is that request's OpenAI-shaped error. Any other exception is logged
with the plugin's name and traceback and becomes a 500 for that request only (`code: "plugin_error"`; in a
stream whose headers are out, a final error event and [DONE]); the server goes on serving.

Loading: `--plugin module:attr` (repeatable; a YAML list under `plugin:`), and every entry point of the
installed group `deepinfer.plugins` (as vLLM loads its general plugins; set DEEPINFER_PLUGINS to a
comma-separated list of entry-point names to load only those, or to "" for none). `attr` may be a plugin
object, a class (instantiated without arguments) or a function returning a plugin.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from deepinfer_jax.server.protocol import APIError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "deepinfer.plugins"
HOOKS = ("on_request", "on_delta", "on_response", "routes")


class Reject(APIError):
    """Raised by a hook to refuse the request with an OpenAI-shaped error (status 400 unless given)."""


class Plugin:
    """Optional base class: every hook passes things through unchanged."""

    name: str | None = None
    blocking = False

    def on_request(self, ctx: "RequestContext", body: dict) -> dict | None:
        return None

    def on_delta(self, ctx: "RequestContext", index: int, text: str, final: bool) -> str:
        return text

    def on_response(self, ctx: "RequestContext", response: dict) -> dict | None:
        return None

    def routes(self) -> list:
        return []


@dataclass
class RequestContext:
    endpoint: str
    request_id: str
    stream: bool = False
    state: dict = field(default_factory=dict)  # {plugin name: anything the plugin keeps for this request}


def plugin_name(p: Any) -> str:
    return getattr(p, "name", None) or type(p).__name__


def _instantiate(obj: Any, where: str) -> Any:
    if inspect.isclass(obj):
        obj = obj()
    elif callable(obj) and not any(callable(getattr(obj, h, None)) for h in HOOKS):
        obj = obj()
    if not any(callable(getattr(obj, h, None)) for h in HOOKS):
        raise ValueError(f"{where} is not a plugin: it has none of the hooks {', '.join(HOOKS)}")
    return obj


def load_spec(spec: str) -> Any:
    """`module:attr` -> the plugin object; ValueError naming the spec when it cannot be loaded."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"--plugin {spec!r}: expected module:attr")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the flag's problem
        raise ValueError(f"--plugin {spec!r}: cannot import {mod_name!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--plugin {spec!r}: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return _instantiate(obj, f"--plugin {spec!r}")


def load_plugins(specs: list[str] | None, *, entry_points: bool = True) -> list[Any]:
    """The plugins of the --plugin flags, then those of the entry-point group (module docstring)."""
    plugins = [load_spec(s) for s in specs or []]
    if entry_points:
        wanted = os.environ.get("DEEPINFER_PLUGINS")
        names = None if wanted is None else {n.strip() for n in wanted.split(",") if n.strip()}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if names is not None and ep.name not in names:
                continue
            try:
                obj = ep.load()
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"plugin entry point {ep.name!r} ({ep.value}): {type(e).__name__}: {e}") from None
            plugins.append(_instantiate(obj, f"plugin entry point {ep.name!r} ({ep.value})"))
    for p in plugins:
        log.info("plugin loaded: %s%s", plugin_name(p), " (blocking: runs on the text threads)"
                 if getattr(p, "blocking", False) else "")
    return plugins


class Plugins:
    """The loaded plugins and the calls into them (module docstring)."""

    def __init__(self, plugins: list[Any], offload: Callable | None = None):
        self.plugins = list(plugins)
        self._offload = offload
        self._by_hook = {h: [p for p in self.plugins if callable(getattr(p, h, None))
                             and not _is_base(p, h)] for h in HOOKS}

    def __bool__(self) -> bool:
        return bool(self.plugins)

    def has(self, hook: str) -> bool:
        return bool(self._by_hook[hook])

    def routes(self) -> list:
        out = []
        for p in self._by_hook["routes"]:
            out += list(p.routes() or [])
        return out

    async def _call(self, p: Any, hook: str, *args) -> Any:
        fn = getattr(p, hook)
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args)
            if getattr(p, "blocking", False) and self._offload is not None:
                return await self._offload(fn, *args)
            return fn(*args)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - this request fails, the server stays up
            name = plugin_name(p)
            log.exception("plugin %s failed in %s", name, hook)
            raise APIError(f"plugin {name!r} failed in {hook}: {type(e).__name__}: {e}", 500, type="server_error",
                           code="plugin_error") from None

    async def on_request(self, ctx: RequestContext, body: Any) -> Any:
        for p in self._by_hook["on_request"]:
            if not isinstance(body, dict):
                break  # the parser reports a body that is not an object
            new = await self._call(p, "on_request", ctx, body)
            if new is not None:
                if not isinstance(new, dict):
                    raise APIError(f"plugin {plugin_name(p)!r} returned a {type(new).__name__} from on_request, "
                                   "not a dict", 500, type="server_error", code="plugin_error")
                body = new
        return body

    async def on_delta(self, ctx: RequestContext, index: int, text: str, final: bool) -> str:
        for p in self._by_hook["on_delta"]:
            text = await self._call(p, "on_delta", ctx, index, text, final)
            if not isinstance(text, str):
                raise APIError(f"plugin {plugin_name(p)!r} returned a {type(text).__name__} from on_delta, not a str",
                               500, type="server_error", code="plugin_error")
        return text

    async def on_response(self, ctx: RequestContext, response: dict) -> dict:
        for p in self._by_hook["on_response"]:
            new = await self._call(p, "on_response", ctx, response)
            if new is not None:
                response = new
        return response


def _is_base(p: Any, hook: str) -> bool:
    """A hook left as `Plugin`'s pass-through (skipped: no call, no thread hop)."""
    impl = getattr(type(p), hook, None)
    return isinstance(p, Plugin) and impl is getattr(Plugin, hook)
