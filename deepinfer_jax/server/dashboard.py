"""The live dashboard: GET /dashboard (the page), GET /dashboard/data (its JSON, also for scripts),
GET /dashboard/assets/NAME (the vendored charting library), and / redirecting to /dashboard.

One source of truth: /dashboard/data is built from `ServerMetrics.snapshot()`, the same registry /metrics
renders, so every number on the page is a /metrics number (or arithmetic on them: the percentiles are
Prometheus' `histogram_quantile` over the same buckets, the hit rate is hits / queries). Rates (requests and
tokens per second) are the page's: differences of the counters between two polls. No prompt or output text
is in the data: only counters, gauges, histograms, the model's name and the server's flags (the API key as
"set").

With --api-key the routes need the key like /v1 does: an `Authorization: Bearer KEY` header (scripts), or,
for a browser, `/dashboard?key=KEY` once, which sets a cookie (HttpOnly, SameSite=Strict, holding an HMAC of
the key, not the key) and redirects to /dashboard without the key in the address.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.metadata
import math
import os
import platform
import subprocess
import time
from typing import Any, Sequence
from urllib.parse import urlencode

from aiohttp import web

from deepinfer_jax import __version__
from deepinfer_jax.server.protocol import APIError
from deepinfer_jax.server.serving import Serving, api_keys, json_response, key_matches

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "dashboard")
UPLOT_VERSION = "1.6.32"
COOKIE = "deepinfer_dashboard"
_ASSET_TYPES = {"uPlot.iife.min.js": "application/javascript", "uPlot.min.css": "text/css"}
P = "deepinfer:"


# ---- numbers ---------------------------------------------------------------------------------------------------
def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: `buckets` is [(upper bound, cumulative count)] ending with +Inf; linear
    interpolation inside the bucket that holds rank q * total; the highest finite bound for the +Inf bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            if n == prev_n:
                return le
            return prev_le + (le - prev_le) * (rank - prev_n) / (n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


def _histogram(snap: dict, name: str) -> dict[str, Any]:
    rows = snap.get(P + name + "_bucket", {})
    cum = sorted(((float(dict(k)["le"]), v) for k, v in rows.items()), key=lambda b: b[0])
    count = snap.get(P + name + "_count", {}).get((), 0.0)
    total = snap.get(P + name + "_sum", {}).get((), 0.0)
    per_bucket, last = [], 0.0
    for le, n in cum:
        per_bucket.append([None if math.isinf(le) else le, n - last])
        last = n
    out: dict[str, Any] = {"count": count, "sum": total, "mean": total / count if count else None,
                           "buckets": per_bucket}
    for q in (0.5, 0.9, 0.99):
        out[f"p{int(q * 100)}"] = quantile(q, cum)
    return out


def _one(snap: dict, name: str, default: float = 0.0) -> float:
    return snap.get(P + name, {}).get((), default)


def _speculative(snap: dict) -> dict[str, Any] | None:
    """Speculative decoding's figures from vLLM's spec_decode_* counters: None when no step verified drafts."""
    def total(name: str) -> float:  # summed over the counters' labels
        return sum(snap.get(P + name, {}).values())

    drafts = total("spec_decode_num_drafts_total")
    if not drafts:
        return None
    tokens, accepted = total("spec_decode_num_draft_tokens_total"), total("spec_decode_num_accepted_tokens_total")
    return {"drafts": drafts, "draft_tokens": tokens, "accepted_tokens": accepted,
            "acceptance_rate": accepted / tokens if tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts}


def dashboard_data(s: Serving) -> dict[str, Any]:
    """The JSON of /dashboard/data (module docstring)."""
    memory = s.memory_report()
    snap = s.metrics.snapshot(s.engine.stats, s.engine.num_requests_in_flight, memory)
    queries, hits = _one(snap, "prefix_cache_queries_total"), _one(snap, "prefix_cache_hits_total")
    finished = {dict(k)["finished_reason"]: v for k, v in snap.get(P + "request_success_total", {}).items()}
    errors = {f"{dict(k)['status']} {dict(k)['type']}": v for k, v in snap.get(P + "request_errors_total", {}).items()}
    mem = {dict(k)["kind"]: v for k, v in snap.get(P + "device_memory_bytes", {}).items()}
    if "limit" in mem and "in_use" in mem:
        mem["free"] = max(mem["limit"] - mem["in_use"], 0.0)
    eng = s.engine
    status = ("draining" if s.draining else "failed" if eng.startup_error is not None else
              "starting" if not eng.ready else "ok" if eng.healthy else "unhealthy")
    return {
        "time": time.time(),
        "status": status,
        "model": {"name": s.model_name, "served_names": s.config.served_model_names, "path": s.config.model_path,
                  "max_model_len": s.max_model_len},
        "device": None if memory is None else {k: memory.get(k) for k in ("platform", "device_kind", "num_devices")},
        "build": build_info(),
        "flags": s.config.flags,
        "requests": {"running": _one(snap, "num_requests_running"), "waiting": _one(snap, "num_requests_waiting"),
                     "in_flight": _one(snap, "num_requests_in_flight")},
        "counters": {"prompt_tokens": _one(snap, "prompt_tokens_total"),
                     "generation_tokens": _one(snap, "generation_tokens_total"),
                     "requests_finished": sum(finished.values()), "finished_by_reason": finished,
                     "preemptions": _one(snap, "num_preemptions_total"),
                     "aborts": finished.get("abort", 0.0), "errors": errors, "errors_total": sum(errors.values()),
                     "prefix_cache_queries": queries, "prefix_cache_hits": hits},
        "kv_cache_usage": _one(snap, "kv_cache_usage_perc"),
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "speculative": _speculative(snap),
        "host_cache": _host_cache(snap, memory),
        "memory": mem,
        "latency": {"ttft": _histogram(snap, "time_to_first_token_seconds"),
                    "itl": _histogram(snap, "inter_token_latency_seconds"),
                    "e2e": _histogram(snap, "e2e_request_latency_seconds"),
                    "queue": _histogram(snap, "request_queue_time_seconds")},
    }


def _host_cache(snap, memory) -> dict[str, Any] | None:
    """The KV cache's host tier (docs/kv-tier.md), None when off: its bytes, usage, hit rate, bytes copied."""
    if not memory or not memory.get("kv_offload"):
        return None
    queries, hits = _one(snap, "kv_offload_queries_total"), _one(snap, "kv_offload_hits_total")
    moved = {dict(k)["direction"]: v for k, v in snap.get(P + "kv_offload_bytes_total", {}).items()}
    return {"bytes": memory["kv_offload"], "usage": _one(snap, "kv_offload_usage_perc"), "queries": queries,
            "hits": hits, "hit_rate": hits / queries if queries else None,
            "bytes_to_host": moved.get("to_host", 0.0), "bytes_to_device": moved.get("to_device", 0.0)}


_BUILD: dict[str, Any] = {}


def build_info() -> dict[str, Any]:
    """Versions and, in a git checkout, the commit (computed once)."""
    if not _BUILD:
        commit = None
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if os.path.exists(os.path.join(root, ".git")):
            try:
                commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=5).stdout.strip() or None
            except (OSError, subprocess.SubprocessError):
                commit = None
        versions = {}
        for dist in ("jax", "jaxlib", "aiohttp"):
            try:
                versions[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                versions[dist] = None
        _BUILD.update(version=__version__, commit=commit, python=platform.python_version(), **versions,
                      uplot=UPLOT_VERSION)
    return dict(_BUILD)


def public_flags(ns) -> dict[str, Any]:
    """The server's flags for the page: every flag's value, the API key only as set / not set."""
    out = {}
    for k, v in sorted(vars(ns).items()):
        if k == "api_key":
            v = "set" if v else None
        out[k] = v if isinstance(v, (str, int, float, bool, type(None))) else [str(x) for x in v] \
            if isinstance(v, (list, tuple)) else str(v)
    return out


# ---- routes ----------------------------------------------------------------------------------------------------
def _cookie_value(api_key: str) -> str:
    return hmac.new(api_key.encode(), b"deepinfer-dashboard", hashlib.sha256).hexdigest()


def routes(s: Serving, api_key: str | Sequence[str] | None) -> list[web.RouteDef]:
    keys = api_keys(api_key)  # any one of them opens the page (its own cookie)
    bearers = [f"Bearer {k}".encode() for k in keys]
    cookies = [_cookie_value(k).encode() for k in keys]

    def allowed(request: web.Request) -> bool:
        if not keys:
            return True
        if key_matches(request.headers.get("Authorization", "").encode(), bearers):
            return True
        return key_matches(request.cookies.get(COOKIE, "").encode(), cookies)

    def guard(request: web.Request) -> None:
        if not allowed(request):
            raise APIError("Invalid or missing API key (open /dashboard?key=KEY once in a browser, or send "
                           "'Authorization: Bearer KEY').", 401, code="invalid_api_key")

    async def page(request: web.Request) -> web.StreamResponse:
        key = request.query.get("key")
        if keys and key is not None:
            if not key_matches(key.encode(), [k.encode() for k in keys]):
                raise APIError("Invalid API key in ?key=.", 401, code="invalid_api_key")
            cookie = _cookie_value(key)
            rest = urlencode([(k, v) for k, v in request.query.items() if k != "key"])
            resp = web.HTTPFound("/dashboard" + (f"?{rest}" if rest else ""))
            resp.set_cookie(COOKIE, cookie, httponly=True, samesite="Strict", path="/")
            raise resp
        guard(request)
        return web.FileResponse(os.path.join(ASSETS, "index.html"), headers={
            "Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-store",
            "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                                       "script-src 'self' 'unsafe-inline'; connect-src 'self'"})

    async def data(request: web.Request) -> web.Response:
        guard(request)
        resp = json_response(request, dashboard_data(s))
        resp.headers["Cache-Control"] = "no-store"
        return resp

    async def asset(request: web.Request) -> web.StreamResponse:
        guard(request)
        name = request.match_info["name"]
        if name not in _ASSET_TYPES:
            raise APIError(f"no dashboard asset {name!r}", 404)
        return web.FileResponse(os.path.join(ASSETS, name), headers={"Content-Type": _ASSET_TYPES[name]})

    async def root(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/dashboard")

    return [web.get("/", root), web.get("/dashboard", page), web.get("/dashboard/data", data),
            web.get("/dashboard/assets/{name}", asset)]
