"""The aiohttp application: routes, the error / auth / request-id middleware, start-up and shutdown.

Start-up: the HTTP port opens at once and the engine loads and compiles on its loop thread; until it
is ready /health answers 503 and generation endpoints 503 with Retry-After. Shutdown (SIGTERM or
SIGINT): /health turns 503, the listening socket closes, in-flight requests get up to
--shutdown-timeout seconds to finish, the rest end with a "shutting down" error (503, or a final error
event and [DONE] in a stream), and the process exits 0.

Slow or oversized clients: a connection gets --read-timeout seconds to send a request's headers (aiohttp's
keep-alive timer, armed when the connection opens) and again its body (408); a Content-Length above
--max-payload-size is a 413 at once, before any of the body is read. A lone UTF-16 surrogate in any string
of a JSON body (an unpaired \ud800-\udfff escape) is a 400. Templating and tokenizing run on the text
threads (Serving.offload), so /health answers while a large prompt is tokenized.

Every error is OpenAI-shaped: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
import time
import uuid
from typing import Any, Callable, Sequence

from aiohttp import web

from deepinfer_jax import __version__
from deepinfer_jax.engine.async_engine import AsyncEngine
from deepinfer_jax.server import dashboard
from deepinfer_jax.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from deepinfer_jax.server.plugins import Plugins, RequestContext, load_plugins
from deepinfer_jax.server.protocol import APIError
from deepinfer_jax.server.serving import REQUEST_ID, Serving, ServingConfig, api_keys, json_response, key_matches
from deepinfer_jax.server.serving_chat import ChatHandler
from deepinfer_jax.server.serving_completion import CompletionHandler

log = logging.getLogger("deepinfer_jax.server")

_SERVING = web.AppKey("serving", Serving)
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_STATUS_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error"}


def _error_response(request: web.Request, e: APIError) -> web.Response:
    request.app[_SERVING].metrics.error(e.status, e.type)
    resp = json_response(request, e.body(), status=e.status)
    headers = dict(e.headers)
    if headers.pop("Connection", None) == "close":  # the unread body stays behind: end the connection
        resp.force_close()
    resp.headers.update(headers)
    return resp


def _middleware(api_key: str | Sequence[str] | None):
    expected = [f"Bearer {k}".encode() for k in api_keys(api_key)]

    @web.middleware
    async def middleware(request: web.Request, handler):
        rid = request.headers.get("X-Request-Id", "")
        request[REQUEST_ID] = rid if _REQUEST_ID_RE.fullmatch(rid) else uuid.uuid4().hex
        try:
            size = request.content_length
            if size is not None and size > request.client_max_size:  # answer now, not after reading the body
                raise APIError(f"request body too large: Content-Length {size} exceeds the {request.client_max_size} "
                               "bytes allowed (--max-payload-size)", 413, code="request_too_large",
                               headers={"Connection": "close"})
            if expected and request.path.startswith(("/v1/", "/admin/")):
                got = request.headers.get("Authorization", "").encode()
                if not key_matches(got, expected):
                    raise APIError("Invalid or missing API key (send 'Authorization: Bearer KEY').", 401,
                                   code="invalid_api_key")
            resp = await handler(request)
        except APIError as e:
            resp = _error_response(request, e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            msg = e.text if e.status != 413 else f"request body too large: {e.text}"
            resp = _error_response(request, APIError(msg, e.status, type=_STATUS_TYPES.get(e.status, "server_error"),
                                                     code=e.status))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - no input may crash the server
            log.exception("unhandled error on %s %s", request.method, request.path)
            resp = _error_response(request, APIError(f"internal server error: {type(e).__name__}: {e}", 500,
                                                     type="server_error", code="internal_error"))
        if not resp.prepared:
            resp.headers["X-Request-Id"] = request[REQUEST_ID]
        return resp

    return middleware


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_READ_TIMEOUT = web.AppKey("read_timeout", float)


def _lone_surrogate_field(obj: Any) -> str | None:
    """The top-level field (or "body") holding a string with a lone UTF-16 surrogate, else None. JSON escapes
    can make one (valid pairs decode to one character); no tokenizer or UTF-8 encoder accepts it."""
    stack = [(obj, None)]
    while stack:
        v, top = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return (top or "body").encode("utf-8", "backslashreplace").decode()  # a key may hold it too
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, top or k))
                stack.append((x, top or k))
        elif isinstance(v, list):
            stack.extend((x, top) for x in v)
    return None


async def read_json(request: web.Request) -> Any:
    try:
        raw = await asyncio.wait_for(request.read(), request.app[_READ_TIMEOUT])
    except web.HTTPRequestEntityTooLarge as e:
        raise APIError(f"request body too large: {e.text}", 413, code="request_too_large") from None
    except asyncio.TimeoutError:
        raise APIError(f"the request body did not arrive within {request.app[_READ_TIMEOUT]:g} s "
                       "(--read-timeout)", 408, code="request_timeout", headers={"Connection": "close"}) from None
    if not raw.strip():
        raise APIError("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate_field(body)
        if where is not None:
            raise APIError(f"'{where}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is "
                           "not text", param=None if where == "body" else where)
    return body


# ---- handlers ------------------------------------------------------------------------------------
def _handlers(s: Serving):
    chat, completion = ChatHandler(s), CompletionHandler(s)
    started = int(time.time())

    async def with_plugins(request, endpoint: str):
        body = await read_json(request)
        if not s.plugins:  # no context, no hook calls
            return body, None
        ctx = RequestContext(endpoint, request[REQUEST_ID],
                             stream=isinstance(body, dict) and body.get("stream") is True)
        return await s.plugins.on_request(ctx, body), ctx

    async def chat_completions(request):
        return await chat(request, *await with_plugins(request, "chat.completions"))

    async def completions(request):
        return await completion(request, *await with_plugins(request, "completions"))

    async def models(request):
        mml = s.max_model_len
        data = [{"id": name, "object": "model", "created": started, "owned_by": "deepinfer",
                 "root": s.config.model_path, "parent": None, "max_model_len": mml}
                for name in s.config.served_model_names]
        return json_response(request, {"object": "list", "data": data})

    async def health(request):
        eng = s.engine
        if s.draining:
            status = "draining"
        elif eng.startup_error is not None:
            status = f"failed: {type(eng.startup_error).__name__}: {eng.startup_error}"
        elif not eng.ready:
            status = "starting"
        elif not eng.healthy:
            status = f"unhealthy: {eng.last_error}"
        else:
            return json_response(request, {"status": "ok"})
        return json_response(request, {"status": status}, status=503)

    async def metrics(request):
        body = s.metrics.render(s.engine.stats, s.engine.num_requests_in_flight, s.memory_report(),
                                s.expert_load_report())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def version(request):
        return json_response(request, {"version": __version__})

    async def tokenize(request):
        body = await read_json(request)
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        s.check_model(body.get("model"))
        chat = "messages" in body
        known = {"model", "return_token_strs"} | ({"messages", "tools", "add_generation_prompt", "chat_template_kwargs"}
                                                  if chat else {"prompt", "add_special_tokens"})
        unknown = sorted(k for k, v in body.items() if k not in known and v is not None)
        if unknown:
            raise APIError(f"'{unknown[0]}' is not supported by /tokenize" + (" with 'messages'" if chat else ""),
                           param=unknown[0])
        if chat:
            from deepinfer_jax.server.protocol import parse_chat_request

            req = parse_chat_request({"messages": body["messages"], "tools": body.get("tools"),
                                      "add_generation_prompt": body.get("add_generation_prompt"),
                                      "chat_template_kwargs": body.get("chat_template_kwargs")})
            def render():
                try:
                    text = s.tokenizer.apply_chat_template(req.messages, tools=req.tools, tokenize=False,
                                                           add_generation_prompt=req.add_generation_prompt,
                                                           **req.chat_template_kwargs)
                except Exception as e:  # noqa: BLE001
                    raise APIError(f"could not apply the chat template: {e}", param="messages") from None
                s.check_chars(text, param="messages")
                return s.tokenizer.encode(text, add_special_tokens=False)

            ids = await s.offload(render)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise APIError("'prompt' (a string) or 'messages' is required", param="prompt")
            add = body.get("add_special_tokens", True)
            if not isinstance(add, bool):
                raise APIError("'add_special_tokens' must be a boolean", param="add_special_tokens")
            s.check_chars(prompt)
            ids = await s.offload(s.tokenizer.encode, prompt, add_special_tokens=add)
        mml = s.max_model_len
        out = {"count": len(ids), "max_model_len": mml, "tokens": ids}
        strs = body.get("return_token_strs")
        if strs is not None and not isinstance(strs, bool):
            raise APIError("'return_token_strs' must be a boolean", param="return_token_strs")
        if strs:
            out["token_strs"] = await s.offload(lambda: [s.token_str(t) for t in ids])
        return json_response(request, out)

    async def detokenize(request):
        body = await read_json(request)
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        s.check_model(body.get("model"))
        unknown = sorted(k for k, v in body.items() if k not in ("model", "tokens") and v is not None)
        if unknown:
            raise APIError(f"'{unknown[0]}' is not supported by /detokenize", param=unknown[0])
        ids = body.get("tokens")
        vocab = s.tokenizer.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError("'tokens' must be a list of token ids", param="tokens")
        bad = next((t for t in ids if not 0 <= t < max(vocab, s.vocab_size or 0)), None)
        if bad is not None:
            raise APIError(f"token id {bad} is out of vocabulary", param="tokens")
        return json_response(request, {"prompt": await s.offload(s.tokenizer.decode, ids)})

    async def rebalance_experts(request):
        """EPLB on command (engine/expert_balance.py): a placement from the expert load observed so far, applied
        between two steps where it lowers the largest EP rank load; answers its figures."""
        s.check_available()
        if getattr(s.engine.engine, "expert_balance", None) is None:
            raise APIError("expert load balancing is off: start the server with --enable-eplb (with "
                           "--enable-expert-parallel, and without --pipeline-parallel-size > 1)", 400,
                           code="eplb_disabled")
        try:
            out = await s.engine.call(lambda eng: eng.expert_balance.rebalance())
        except ValueError as e:  # no load observed yet
            raise APIError(str(e), 400, code="no_expert_load") from None
        return json_response(request, {k: (bool(v) if k == "applied" else float(v)) for k, v in out.items()})

    return [web.post("/v1/chat/completions", chat_completions), web.post("/v1/completions", completions),
            web.get("/v1/models", models), web.get("/health", health), web.get("/ping", health),
            web.get("/metrics", metrics), web.get("/version", version), web.post("/tokenize", tokenize),
            web.post("/detokenize", detokenize), web.post("/admin/rebalance_experts", rebalance_experts)]


def build_app(serving: Serving, *, api_key: str | Sequence[str] | None = None, max_payload_size: int = 16 * 2**20,
              read_timeout: float = 60.0) -> web.Application:
    app = web.Application(client_max_size=max_payload_size, middlewares=[_middleware(api_key)])
    app[_SERVING] = serving
    app[_READ_TIMEOUT] = read_timeout
    app.add_routes(_handlers(serving))
    app.add_routes(dashboard.routes(serving, api_key))
    app.add_routes(serving.plugins.routes())
    return app


# ---- running -------------------------------------------------------------------------------------
class RunningServer:
    """An app listening on (host, port) with its engine; `shutdown()` drains and stops both."""

    def __init__(self, runner: web.AppRunner, site: web.TCPSite, serving: Serving, shutdown_timeout: float = 30.0):
        self.runner, self.site, self.serving = runner, site, serving
        self.shutdown_timeout = shutdown_timeout
        self.engine = serving.engine
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.host, self.port = sock.getsockname()[:2]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def shutdown(self, timeout: float | None = None) -> None:
        """Stop listening, let in-flight requests finish for up to `timeout` (--shutdown-timeout) seconds, then
        stop the engine: the requests still running end with the server's "shutting down" error (a 503, or in
        a stream a final error event and [DONE]) rather than a cut connection."""
        self.serving.draining = True
        timeout = self.shutdown_timeout if timeout is None else timeout
        await self.site.stop()
        n = self.engine.num_requests_in_flight
        if n:
            log.info("shutting down: letting %d in-flight request(s) finish (up to %g s)", n, timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.engine.num_requests_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        # a thread still loading / compiling cannot be interrupted: do not wait for it (serve() exits anyway)
        wait = 10.0 if self.engine.ready else 0.0
        await loop.run_in_executor(None, self.engine.shutdown, wait)
        await self.runner.cleanup()  # the cut requests write their last events; then cancel what is left
        self.serving.close()


async def start_server(ns, *, build: Callable[[], Any] | None = None, tokenizer: Any = None) -> RunningServer:
    """Open the port and start loading the engine (in the background) from parsed flags `ns`."""
    from deepinfer_jax.server.args import DEFAULT_MODEL_NOTE, engine_kwargs, resolve_model, show_progress

    model_dir, default_name = resolve_model(ns)
    if not ns.model:
        log.info("no --model given: serving %s", DEFAULT_MODEL_NOTE)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir!r} is not a model directory (no config.json)")
    if tokenizer is None:
        from deepinfer_jax.text import load_tokenizer

        tokenizer = load_tokenizer(model_dir, chat_template=ns.chat_template)
    if build is None:
        progress = show_progress(logging.getLogger().getEffectiveLevel())

        def build():
            from deepinfer_jax.engine.llm import LLM

            kw, note = engine_kwargs(ns, progress=progress)
            if note:
                log.info("%s", note)
            log.info("loading %s", model_dir)
            llm = LLM(model_dir, **kw)
            log.info("engine ready in %.1f s (%d step shapes compiled); KV cache: %s", llm.startup_seconds,
                     llm.engine.num_warmup_compiles, llm.engine.kv_cache_report)
            return llm.engine

    from deepinfer_jax.text.generation_config import load_sampling_defaults

    defaults = load_sampling_defaults(model_dir, getattr(ns, "generation_config", "auto"))  # ValueError: cannot start
    if defaults.log_line():
        log.warning("%s", defaults.log_line())
    names = list(ns.served_model_name or [default_name])
    plugins = load_plugins(ns.plugin)  # a plugin that cannot be loaded stops the start (ValueError)
    engine = AsyncEngine(build, max_queue_len=ns.max_queue_len, log_stats=not getattr(ns, "disable_log_stats", False))
    config = ServingConfig(served_model_names=names, model_path=model_dir, max_model_len=ns.max_model_len,
                           reasoning_parser=ns.reasoning_parser, tool_call_parser=ns.tool_call_parser,
                           max_request_sequences=ns.max_request_sequences,
                           max_completion_prompts=ns.max_completion_prompts, flags=dashboard.public_flags(ns),
                           enable_auto_tool_choice=ns.enable_auto_tool_choice, sampling_defaults=defaults)
    serving = Serving(engine, tokenizer, config, ServerMetrics(names[0]))
    serving.plugins = Plugins(plugins, serving.offload)
    app = build_app(serving, api_key=ns.api_key, max_payload_size=ns.max_payload_size, read_timeout=ns.read_timeout)
    # keepalive_timeout also bounds a connection that has not sent a whole request's headers (aiohttp arms it
    # when the connection opens): that is the header read timeout
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None,
                           keepalive_timeout=ns.read_timeout)
    await runner.setup()
    site = web.TCPSite(runner, ns.host, ns.port, reuse_address=True)
    await site.start()
    server = RunningServer(runner, site, serving, ns.shutdown_timeout)
    engine.start()
    log.info("listening on %s (model %s served as %s); /health is 503 until the engine is ready; dashboard at "
             "%s/dashboard", server.url, model_dir, names[0], server.url)
    return server


def _follow(ns) -> int:
    """`deepinfer serve --node-rank R` (R > 0): no API server; load the weights, warm up and run rank 0's steps
    until rank 0 exits (runner/multihost.py)."""
    from deepinfer_jax.engine.llm import LLM
    from deepinfer_jax.server.args import engine_kwargs, resolve_model

    model_dir, _ = resolve_model(ns)
    kw, _ = engine_kwargs(ns, progress=False)
    log.info("rank %d of %d: loading %s, then following rank 0's steps", ns.node_rank, ns.nnodes, model_dir)
    LLM(model_dir, **kw)
    log.info("rank 0 has closed the step channel; exiting")
    return 0


def configure_logging(ns) -> None:
    """--log-level for everything; --uvicorn-log-level (vLLM's, for its HTTP server) for the HTTP server's own
    loggers, aiohttp's here (vLLM's `trace` is debug)."""
    logging.basicConfig(level=getattr(logging, ns.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ns.log_level != "debug":  # JAX's INFO lines (e.g. the TPU backend it did not find) are noise to a user
        logging.getLogger("jax").setLevel(logging.WARNING)
    level = getattr(ns, "uvicorn_log_level", None)
    if level is not None:
        logging.getLogger("aiohttp").setLevel(logging.DEBUG if level == "trace" else getattr(logging, level.upper()))


def serve(ns) -> int:
    """`deepinfer serve`: run until SIGTERM / SIGINT, then drain and exit 0."""
    configure_logging(ns)

    if getattr(ns, "nnodes", 1) > 1:  # jax.distributed before anything touches JAX's backends (engine_kwargs does)
        from deepinfer_jax.engine.llm import init_distributed

        init_distributed(ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port)
        if ns.node_rank > 0:
            return _follow(ns)
    holder: list[RunningServer] = []

    async def main() -> int:
        try:
            server = await start_server(ns)
        except (OSError, ValueError) as e:
            log.error("cannot start: %s", e)
            return 2
        holder.append(server)
        stop = asyncio.Event()
        rc = [0]
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        def announce():
            if server.engine.ready:
                log.info("ready: serving at %s", server.url)
            else:
                log.error("the engine failed to start: %s", server.engine.startup_error)
                rc[0] = 1
                stop.set()

        server.engine.add_ready_callback(lambda: loop.call_soon_threadsafe(announce))
        await stop.wait()
        if rc[0] == 0:
            log.info("signal received; draining")
        await server.shutdown()
        return rc[0]

    rc = asyncio.run(main())
    log.info("stopped")
    if holder and holder[0].engine.thread_alive:
        # the engine thread is still loading / compiling: do not wait for it at interpreter exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc
