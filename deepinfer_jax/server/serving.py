"""What the chat and completions handlers share: admission checks, submitting to the AsyncEngine with
metrics, merging several requests' streams, SSE writing and the disconnect rule.

A request the engine refuses when it adds it (LLMEngine.add_request's ValueError, raised on the engine thread and
delivered through the stream) is a 400, or in a stream whose headers are out an error event with status 400.

Disconnects: a streaming client that goes away makes the next write raise ConnectionResetError; a
non-streaming one gets its handler task cancelled (the app runs with handler_cancellation). Both
leave `tracked()` early, whose `finally` aborts the engine request, freeing its blocks before the
next engine step.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from aiohttp import web

from deepinfer_jax.engine.async_engine import (AsyncEngine, EngineNotReadyError, EngineStepError,
                                               QueueFullError, RequestStream)
from deepinfer_jax.server.metrics import ServerMetrics
from deepinfer_jax.server.plugins import Plugins, RequestContext
from deepinfer_jax.server.protocol import APIError, error_body
from deepinfer_jax.text.generation_config import SamplingDefaults
from deepinfer_jax.types import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

REQUEST_ID = web.RequestKey("request_id", str)


@dataclass
class ServingConfig:
    served_model_names: list[str]
    model_path: str
    max_model_len: int | None  # the flag; None until the engine has resolved it
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    retry_after_s: int = 1
    max_request_sequences: int = 1024  # prompts x n of one request (--max-request-sequences)
    max_completion_prompts: int = 1024  # prompts in one completions request (vLLM's VLLM_MAX_COMPLETION_PROMPTS)
    flags: dict = field(default_factory=dict)  # the server's flags as the dashboard shows them (no API key)
    extra: dict = field(default_factory=dict)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)  # --generation-config's


class Serving:
    """Shared state of the OpenAI handlers (one per app)."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, config: ServingConfig, metrics: ServerMetrics):
        self.engine, self.tokenizer, self.config, self.metrics = engine, tokenizer, config, metrics
        self.model_name = config.served_model_names[0]
        self.draining = False
        self._ids = itertools.count()
        self._tok_str: dict[int, str] = {}
        self._longest_token: int | None = None
        self.plugins = Plugins([])
        # tokenizing and template rendering run here, never on the event loop (/health must not wait on them)
        self._text_pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                             thread_name_prefix="deepinfer-text")

    async def offload(self, fn, *args, **kwargs):
        """Run CPU-bound text work (templating, tokenizing) on the text threads; its exceptions propagate."""
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        self._text_pool.shutdown(wait=False, cancel_futures=True)

    # ---- checks ----------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.config.served_model_names:
            raise APIError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")
        return self.model_name

    def check_available(self) -> None:
        if self.draining:
            raise APIError("the server is shutting down", 503, type="server_error", code="shutting_down")
        if not self.engine.ready:
            msg = ("the engine failed to start" if self.engine.startup_error is not None
                   else "the model is still loading; retry shortly")
            raise APIError(msg, 503, type="server_error", code="engine_not_ready",
                           headers={"Retry-After": str(self.config.retry_after_s)})

    def memory_report(self) -> dict | None:
        """The engine's device memory figures (LLMEngine.memory_report), or None before it is ready."""
        eng = self.engine.engine
        if not self.engine.ready or eng is None or not hasattr(eng, "memory_report"):
            return None
        try:
            return eng.memory_report()
        except Exception:  # noqa: BLE001 - a backend without figures must not fail a scrape
            log.debug("memory report failed", exc_info=True)
            return None

    def expert_load_report(self) -> dict | None:
        """With --enable-eplb, the engine's observed expert load (LLMEngine.expert_load_report); else None."""
        eng = self.engine.engine
        if not self.engine.ready or eng is None or not hasattr(eng, "expert_load_report"):
            return None
        return eng.expert_load_report()

    @property
    def max_model_len(self) -> int | None:
        """The engine's context length once it is built (the --max-model-len flag before that)."""
        eng = self.engine.engine
        return eng.max_model_len if self.engine.ready and eng is not None else self.config.max_model_len

    @property
    def vocab_size(self) -> int | None:
        eng = self.engine.engine
        return getattr(getattr(eng, "cfg", None), "vocab_size", None)

    @property
    def max_prompt_chars(self) -> int | None:
        """Characters beyond which a text can never fit max_model_len tokens: no token is longer than the
        vocabulary's longest token string, so a text of more characters than max_model_len times that has more
        than max_model_len tokens. Checked before tokenizing, so a huge text costs no tokenizer time."""
        mml = self.max_model_len
        id_to_token = getattr(self.tokenizer, "id_to_token", None)
        if mml is None or id_to_token is None:
            return None
        if self._longest_token is None:
            self._longest_token = max(len(id_to_token(i) or "") for i in range(self.tokenizer.vocab_size)) or 1
        return mml * self._longest_token

    def check_chars(self, text: str, *, param: str = "prompt") -> None:
        cap = self.max_prompt_chars
        if cap is not None and len(text) > cap:
            has = "have" if param == "messages" else "has"
            raise APIError(f"the {param} {has} {len(text)} characters, more than the {self.max_model_len} tokens of "
                           f"this model's maximum context length can hold (at most {cap} characters)", param=param)

    def check_prompt_count(self, count: int) -> None:
        limit = self.config.max_completion_prompts
        if count > limit:  # vLLM's check and wording
            raise APIError(f"prompt list length {count} exceeds the maximum allowed count of {limit} "
                           "(--max-completion-prompts)", param="prompt")

    def check_sequences(self, total: int, *, prompts: int = 1, field: str = "n") -> None:
        """400 for a request of more sequences (prompts x n, or x best_of where that is larger: the engine runs
        them all) than the server allows per request or could ever admit at once (--max-num-seqs +
        --max-queue-len): a retry could never succeed, so no 429. `field`: the request field that sets the count."""
        limit = self.config.max_request_sequences
        what = f"{prompts} prompts x {field}={total // max(prompts, 1)}" if prompts > 1 else f"{field}={total}"
        param = field if prompts == 1 else "prompt"
        if total > limit:
            raise APIError(f"this request asks for {total} sequences ({what}); at most {limit} are allowed per "
                           "request (--max-request-sequences)", param=param)
        eng = self.engine
        if eng.max_queue_len is not None and eng.max_num_seqs is not None:
            cap = eng.max_num_seqs + eng.max_queue_len
            if total > cap:
                raise APIError(f"this request asks for {total} sequences ({what}), more than this server can ever "
                               f"hold at once ({eng.max_num_seqs} running + {eng.max_queue_len} waiting, "
                               "--max-num-seqs + --max-queue-len)", param=param)

    def check_prompt(self, ids: list[int], params: SamplingParams, *, what: str = "messages") -> None:
        n = len(ids)
        mml = self.max_model_len
        if n == 0:
            raise APIError("the prompt is empty", param="prompt")
        vocab = self.vocab_size
        if vocab is not None:
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(f"token id {bad} is out of vocabulary [0, {vocab})", param="prompt")
        if params.structured_outputs is not None and getattr(self.tokenizer, "backend_kind", None) != "tokenizers":
            raise APIError("structured output needs a tokenizer.json (Hugging Face tokenizers) tokenizer; this "
                           f"model's is {getattr(self.tokenizer, 'backend_kind', None)}")
        for name, given, sep in (("stop_token_ids", params.stop_token_ids, ":"), ("logit_bias", params.logit_bias, "")):
            bad = next((t for t in given or () if not 0 <= t < vocab), None) if vocab is not None else None
            if bad is not None:
                raise APIError(f"{name}{sep} token id {bad} is out of vocabulary [0, {vocab})", param=name)
        want = params.max_tokens
        if n >= mml:
            has = "have" if what == "messages" else "has"
            raise APIError(f"This model's maximum context length is {mml} tokens. However, your {what} {has} {n} "
                           "tokens, which leaves no room for the completion.",
                           param="messages" if what == "messages" else "prompt")
        if want is not None and n + want > mml:
            raise APIError(f"This model's maximum context length is {mml} tokens. However, you requested "
                           f"{n + want} tokens ({n} in the {what}, {want} in the completion). Please reduce "
                           f"the length of the {what} or completion.", param="max_tokens")
        if want is None and params.min_tokens > mml - n:  # max_tokens defaults to what fits: min_tokens must too
            raise APIError(f"min_tokens={params.min_tokens} cannot fit: this model's maximum context length is {mml} "
                           f"tokens, {n} of them taken by the {what}, which leaves {mml - n}", param="min_tokens")

    # ---- submitting --------------------------------------------------------------------------------
    def new_engine_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def submit(self, rid: str, ids: list[int], params: SamplingParams, prompt: str | None,
               keep: tuple[str, ...] = ()) -> RequestStream:
        try:
            return self.engine.submit(rid, ids, params, prompt=prompt, keep_special_tokens=keep)
        except QueueFullError as e:
            raise APIError(str(e), 429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except EngineNotReadyError as e:
            raise APIError(str(e), 503, type="server_error", code="engine_not_ready",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except ValueError as e:
            raise APIError(str(e)) from None

    async def tracked(self, stream: RequestStream, prompt_len: int) -> AsyncIterator[RequestOutput]:
        """Iterate a stream, feeding the latency metrics; abort the request if left early.

        TTFT and inter-token gaps come from the engine thread's timestamps, so they do not depend on
        how quickly this event loop gets to each output."""
        gen = 0
        reasons: dict[int, str | None] = {}
        ok = first = False
        try:
            async for out in stream:
                if not first and stream.first_token_time is not None:
                    first = True
                    self.metrics.first_token(stream.first_token_time - stream.arrival_time)
                for gap in stream.take_token_gaps():
                    self.metrics.inter_token(gap)
                for c in out.outputs:
                    gen += len(c.token_ids)
                    if c.finish_reason is not None:
                        reasons[c.index] = c.finish_reason
                yield out
            ok = True
        except EngineStepError:
            reasons = {i: "error" for i in range(stream.num_seqs)}
            raise
        except ValueError as e:  # LLMEngine.add_request refused the request (on the engine thread): its fault
            raise APIError(str(e)) from None
        finally:
            stream.abort()
            q = None if stream.scheduled_time is None else stream.scheduled_time - stream.arrival_time
            if not ok:
                reasons = {i: reasons.get(i) or "abort" for i in range(stream.num_seqs)}
            self.metrics.finished(e2e=time.time() - stream.arrival_time, queue=q, prompt_tokens=prompt_len,
                                  generation_tokens=gen, reasons=[reasons.get(i) or "abort"
                                                                  for i in range(stream.num_seqs)])

    async def merged(self, iters: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
        """Interleave several async iterators: yields (iterator index, item) in arrival order."""
        if len(iters) == 1:
            async for item in iters[0]:
                yield 0, item
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i, it):
            try:
                async for item in it:
                    await queue.put((i, item))
                await queue.put((i, done))
            except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iters)]
        left = len(iters)
        try:
            while left:
                i, item = await queue.get()
                if item is done:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for it in iters:
                aclose = getattr(it, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except BaseException:  # noqa: BLE001
                        pass

    async def delta(self, ctx: RequestContext | None, index: int, text: str, final: bool) -> str:
        """An output delta through the plugins' on_delta (as is without plugins)."""
        if ctx is None or not self.plugins.has("on_delta"):
            return text
        return await self.plugins.on_delta(ctx, index, text, final)

    # ---- output helpers --------------------------------------------------------------------------
    def token_str(self, tid: int) -> str:
        s = self._tok_str.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else f"token_id:{tid}"
            if len(self._tok_str) < 1_000_000:
                self._tok_str[tid] = s
        return s


class SSE:
    """A text/event-stream response; `send` raises ConnectionResetError once the client is gone."""

    def __init__(self, request: web.Request):
        self.request = request
        self.resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Request-Id": request.get(REQUEST_ID, "")})

    async def start(self) -> None:
        await self.resp.prepare(self.request)

    async def send(self, obj: Any) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        await self.resp.write(f"data: {data}\n\n".encode())

    async def error(self, message: str, status: int = 500, type: str = "server_error") -> None:
        body = error_body(message, type, None, status)
        await self.send(body)

    async def done(self) -> web.StreamResponse:
        await self.send("[DONE]")
        await self.resp.write_eof()
        return self.resp


def json_response(request: web.Request, obj: Any, status: int = 200, *, body: bytes | None = None) -> web.Response:
    # backslashreplace: a lone surrogate echoed from a request must not turn the reply into a 500
    if body is None:
        body = json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace")
    return web.Response(body=body, status=status, content_type="application/json",
                        headers={"X-Request-Id": request.get(REQUEST_ID, "")})


def _json_pieces(obj: Any, depth: int, out: list[str]) -> None:
    """json.dumps(obj, ensure_ascii=False) as pieces: containers of the top `depth` levels are taken apart, so that
    no one C encoder call (which holds the GIL throughout) is larger than one element of a choice's logprobs."""
    if depth == 0 or not isinstance(obj, (dict, list)) or not obj or (
            isinstance(obj, dict) and not all(isinstance(k, str) for k in obj)):  # (json.dumps turns 5 into "5")
        out.append(json.dumps(obj, ensure_ascii=False))
        return
    items = obj.items() if isinstance(obj, dict) else ((None, v) for v in obj)
    out.append("{" if isinstance(obj, dict) else "[")
    for i, (k, v) in enumerate(items):
        if i:
            out.append(", ")
        if k is not None:
            out.append(json.dumps(k, ensure_ascii=False) + ": ")
        _json_pieces(v, depth - 1, out)
    out.append("}" if isinstance(obj, dict) else "]")


def encode_reply(obj: Any) -> bytes:
    """A completion reply's JSON bytes (as json_response's), made on a text thread (Serving.offload): with n choices
    of many tokens and top logprobs a reply is tens of MB, seconds of encoding that must not hold the event loop."""
    out: list[str] = []
    _json_pieces(obj, 4, out)  # reply -> choices -> choice -> logprobs -> (content | tokens, token_logprobs, ...)
    return "".join(out).encode("utf-8", "backslashreplace")


async def send_error(sse: SSE, message: str, status: int = 500, metrics: ServerMetrics | None = None) -> None:
    """An error event inside a stream whose headers are out (a client that left is fine)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    if metrics is not None:
        metrics.error(status, kind)
    try:
        await sse.error(message, status, kind)
    except ConnectionResetError:
        pass


def shutting_down(e: BaseException) -> APIError:
    """The 503 of a request cut by the shutdown (EngineNotReadyError raised mid-request)."""
    return APIError(str(e), 503, type="server_error", code="shutting_down")


def api_keys(api_key: str | Sequence[str] | None) -> tuple[str, ...]:
    """--api-key's keys: one, several (vLLM's `--api-key K1 K2`: any one is accepted) or none ('' is none)."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    return tuple(k for k in keys if k)


def key_matches(got: bytes, expected: Sequence[bytes]) -> bool:
    """Whether `got` is one of `expected`, comparing with every one (constant time each)."""
    return any([hmac.compare_digest(got, e) for e in expected])
