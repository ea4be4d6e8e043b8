"""POST /v1/completions: one engine request per prompt, choices numbered prompt_index * n + i.

Prompts may be a string, a list of strings, token ids or a list of token-id lists. Text prompts get
the tokenizer's BOS (once); token-id prompts are used as given. `echo` prepends the prompt text
(token-id prompts are decoded). If one prompt of a batch is refused (429, 400), the ones already
submitted are aborted and the whole request fails.
"""

from __future__ import annotations

import logging
import time
from contextlib import aclosing
from typing import Any

from aiohttp import web

from deepinfer_jax.engine.async_engine import EngineNotReadyError, EngineStepError
from deepinfer_jax.server.protocol import (APIError, completion_logprobs, echo_logprobs, envelope, merge_logprobs,
                                           parse_completion_request, prompt_logprobs_json, random_id, usage)
from deepinfer_jax.server.serving import (SSE, Serving, encode_reply, json_response, send_error,
                                          shutting_down)

log = logging.getLogger(__name__)


class _Choice:
    def __init__(self, index: int, echo: str, prompt_ids: list[int]):
        self.index = index
        self.echo = echo
        self.prompt_ids = prompt_ids
        self.prompt_logprobs: list | None = None  # from the prompt's first output, when asked for
        self.text: list[str] = [echo] if echo else []
        self.offset = len(echo)
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.stop_reason: Any = None


class CompletionHandler:
    def __init__(self, serving: Serving):
        self.s = serving

    async def __call__(self, request: web.Request, body: Any, ctx=None) -> web.StreamResponse:
        s = self.s
        req = parse_completion_request(body, s.config.sampling_defaults)
        model = s.check_model(req.model)
        s.check_available()
        params = req.params
        s.check_prompt_count(len(req.prompts))
        per_prompt = params.best_of or params.n
        s.check_sequences(len(req.prompts) * per_prompt, prompts=len(req.prompts),
                          field="best_of" if per_prompt > params.n else "n")
        for p in req.prompts:
            if isinstance(p, str):
                s.check_chars(p)
        encoded: list[tuple[list[int], str | None]] = await s.offload(
            lambda: [(s.tokenizer.encode(p) if isinstance(p, str) else list(p), p if isinstance(p, str) else None)
                     for p in req.prompts])
        for ids, _ in encoded:
            s.check_prompt(ids, params, what="prompt")
        echoes = [""] * len(encoded)
        if req.echo:  # token-id prompts are decoded (on the text threads, before any request is in the engine)
            echoes = await s.offload(lambda: [t if t is not None else s.tokenizer.decode(ids) for ids, t in encoded])
        streams = []
        try:
            for ids, text in encoded:
                streams.append(s.submit(s.new_engine_id("cmpl"), ids, params, text))
        except BaseException:
            for st in streams:
                st.abort()
            raise
        n = params.n
        choices = []
        for (ids, _), echo in zip(encoded, echoes):
            choices += [_Choice(len(choices) + i, echo, ids) for i in range(n)]
        cached = [0] * len(encoded)
        iters = [s.tracked(st, len(ids)) for st, (ids, _) in zip(streams, encoded)]
        cid, created = random_id("cmpl"), int(time.time())
        k = params.logprobs
        prompt_tokens = sum(len(ids) for ids, _ in encoded)

        def n_out() -> int:
            return sum(len(ch.token_ids) for ch in choices)

        if req.stream:
            return await self._stream(request, req, iters, streams, choices, cached, cid, created, model, k,
                                      prompt_tokens, n_out, ctx)
        try:
            async with aclosing(s.merged(iters)) as it:
                async for pi, out in it:
                    cached[pi] = out.num_cached_tokens
                    for c in out.outputs:
                        ch = choices[pi * n + c.index]
                        if out.prompt_logprobs is not None:
                            ch.prompt_logprobs = out.prompt_logprobs
                        ch.text.append(await s.delta(ctx, ch.index, c.text, c.finish_reason is not None))
                        ch.token_ids += c.token_ids
                        ch.logprobs += c.logprobs or []
                        if c.finish_reason is not None:
                            ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
        except EngineStepError as e:
            raise APIError(str(e), 500, type="server_error", code="engine_error") from None
        except EngineNotReadyError as e:
            raise shutting_down(e) from None
        finally:
            for st in streams:
                st.abort()

        def reply() -> dict:  # on a text thread: with logprobs a reply takes seconds to build (encode_reply)
            out_choices = [{"index": ch.index, "text": "".join(ch.text),
                            "logprobs": self._logprobs(req, ch, k) if k is not None else None,
                            "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason} for ch in choices]
            if req.params.prompt_logprobs is not None and not (req.echo and k is not None):
                for item, ch in zip(out_choices, choices):
                    item["prompt_logprobs"] = prompt_logprobs_json(ch.prompt_logprobs, s.token_str)
            return envelope(cid, "text_completion", model, created, choices=out_choices,
                            usage=usage(prompt_tokens, n_out(), sum(cached)))

        obj = await s.offload(reply)
        if ctx is not None and s.plugins.has("on_response"):
            obj = await s.plugins.on_response(ctx, obj)
        return json_response(request, obj, body=await s.offload(encode_reply, obj))

    def _echo_logprobs(self, req, ch: _Choice, k: int) -> dict | None:
        """The echoed prompt's part of a choice's `logprobs` (echo with logprobs), else None; the generated
        tokens' offsets then continue from the prompt's (`ch.offset`)."""
        if not (req.echo and ch.prompt_logprobs is not None):
            return None
        lp = echo_logprobs(ch.prompt_ids, ch.prompt_logprobs, k, self.s.token_str)
        ch.offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return lp

    def _logprobs(self, req, ch: _Choice, k: int) -> dict:
        """A whole choice's `logprobs`: the echoed prompt's (echo), then the generated tokens'."""
        echo = self._echo_logprobs(req, ch, k)
        return merge_logprobs(echo, completion_logprobs(ch.token_ids, ch.logprobs, k, self.s.token_str, ch.offset))

    async def _stream(self, request, req, iters, streams, choices, cached, cid, created, model, k,
                      prompt_tokens, n_out, ctx) -> web.StreamResponse:
        s = self.s
        sse = SSE(request)
        n = req.params.n

        def chunk(chs: list, **extra) -> dict:
            if req.continuous_usage and "usage" not in extra:  # the tokens so far, in every chunk (vLLM)
                extra["usage"] = usage(prompt_tokens, n_out(), sum(cached))
            return envelope(cid, "text_completion", model, created, choices=chs, **extra)

        echo_lp = req.echo and k is not None  # (prompt_logprobs alone is not streamed: protocol.py refuses it)
        try:
            await sse.start()
            for ch in choices:
                if ch.echo and k is None:
                    await sse.send(chunk([{"index": ch.index, "text": ch.echo, "logprobs": None,
                                           "finish_reason": None}]))
            async with aclosing(s.merged(iters)) as it:
                async for pi, out in it:
                    cached[pi] = out.num_cached_tokens
                    for c in out.outputs:
                        ch = choices[pi * n + c.index]
                        if echo_lp and out.prompt_logprobs is not None and ch.prompt_logprobs is None:
                            # the prompt's first output: its echo, with the prompt's logprobs
                            ch.prompt_logprobs = out.prompt_logprobs
                            await sse.send(chunk([{"index": ch.index, "text": ch.echo,
                                                   "logprobs": self._echo_logprobs(req, ch, k),
                                                   "finish_reason": None}]))
                        ch.token_ids += c.token_ids
                        final = c.finish_reason is not None
                        text = await s.delta(ctx, ch.index, c.text, final)
                        lp = None
                        if k is not None and c.logprobs:
                            lp = completion_logprobs(c.token_ids, c.logprobs, k, s.token_str, ch.offset)
                            ch.offset += sum(len(t) for t in lp["tokens"])
                        if not (text or lp or final):
                            continue
                        item = {"index": ch.index, "text": text, "logprobs": lp, "finish_reason": None}
                        if final:
                            item["finish_reason"], item["stop_reason"] = c.finish_reason, c.stop_reason
                        await sse.send(chunk([item]))
            if req.include_usage:
                await sse.send(chunk([], usage=usage(prompt_tokens, n_out(), sum(cached))))
        except ConnectionResetError:
            return sse.resp
        except (EngineStepError, EngineNotReadyError) as e:
            await send_error(sse, str(e), 503 if isinstance(e, EngineNotReadyError) else 500, s.metrics)
        except APIError as e:  # a plugin's failure, or a request the engine refused (400)
            await send_error(sse, e.message, e.status, s.metrics)
        except Exception as e:  # noqa: BLE001 - headers are out: report in-band
            log.exception("completion stream failed")
            await send_error(sse, f"internal error: {type(e).__name__}: {e}", 500, s.metrics)
        finally:
            for st in streams:
                st.abort()
        try:
            return await sse.done()
        except ConnectionResetError:
            return sse.resp
