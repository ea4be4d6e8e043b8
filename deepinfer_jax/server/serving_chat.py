"""POST /v1/chat/completions: template rendering, reasoning split, tool calls, streaming and not.

Per choice, the engine's text deltas go through the reasoning parser (`--reasoning-parser`) and then,
when tools are in play, the tool-call parser (`--tool-call-parser`), as text/README.md describes.
Reasoning is sent as both `reasoning_content` (DeepSeek's name) and `reasoning` (vLLM's newer name).

tool_choice: "none" -> tools stay in the prompt, no parsing; "auto" (needs --enable-auto-tool-choice, as in vLLM;
without it a request with tools and no tool_choice is "none", and an explicit "auto" a 400) -> parsed, finish_reason
"tool_calls" when the model called one (with parallel_tool_calls false only its first call is returned, the
later ones are parsed and dropped, as vLLM does); "required" -> the assistant turn is started with the tool-call
block markers and a grammar (text/grammar.py `tool_call_grammar`) holds the model to one call of a given
function (several with `parallel_tool_calls`, the default) in the parser's format, its arguments valid under
the function's `parameters` schema, and then the block's end; a named function -> the turn is started with
the whole call head (markers, name, and for deepseek_v3 the ```json fence) and the grammar holds the model
to that function's arguments and the block's end. Either way `tool_calls` is filled and finish_reason is
"tool_calls" (unless max_tokens cuts the call: "length"). A forced call cannot be combined with
response_format or vLLM's guided fields (400).

Structured output with a reasoning parser, where the prompt opens the reasoning (R1's `<think>`): the grammar
starts after `</think>` (StructuredOutputsParams.after_token_id), so it holds the answer, not the reasoning.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import aclosing
from typing import Any

from aiohttp import web

from deepinfer_jax.engine.async_engine import EngineNotReadyError, EngineStepError
from deepinfer_jax.server.protocol import (APIError, ChatRequest, chat_logprobs, envelope, parse_chat_request,
                                           prompt_logprobs_json, random_id, usage)
from deepinfer_jax.server.serving import (SSE, Serving, encode_reply, json_response, send_error,
                                          shutting_down)
from deepinfer_jax.text import (FORCEABLE_TOOL_PARSERS, ToolCallDelta, collect_tool_stream, deltas_to_openai,
                                get_reasoning_parser, get_tool_parser, prompt_opens_reasoning)
from deepinfer_jax.text.reasoning import THINK_END
from deepinfer_jax.text.tool_parsers import CALL_BEGIN, CALLS_BEGIN, TOOL_SEP
from deepinfer_jax.types import StructuredOutputsParams

log = logging.getLogger(__name__)


def forced_tool_prefix(parser: str, named: str | None) -> str:
    """Assistant-turn prefix that commits the model to a tool call (see the module docstring)."""
    if parser == "deepseek_v31":
        return CALLS_BEGIN + CALL_BEGIN + (named + TOOL_SEP if named else "")
    return CALLS_BEGIN + CALL_BEGIN + "function" + TOOL_SEP + (named + "\n```json\n" if named else "")


class _Choice:
    """Parser state and accumulated output of one choice."""

    def __init__(self, index: int, rp, tp, pending: list, include_reasoning: bool, named: bool, parallel: bool = True):
        self.index, self.rp, self.tp = index, rp, tp
        self.pending, self.include_reasoning, self.named = pending, include_reasoning, named
        self.parallel = parallel  # parallel_tool_calls: false keeps the first call only (as vLLM)
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_deltas: list[ToolCallDelta] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.stop_reason: Any = None

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        r, c = self.rp.feed(text) if self.rp is not None else ("", text)
        if final and self.rp is not None:
            r2, c2 = self.rp.flush()
            r, c = r + r2, c + c2
        tool_calls: list = []
        if self.tp is not None:
            ds, self.pending = self.pending + self.tp.feed(c), []
            if final:
                ds += self.tp.flush()
            if not self.parallel:
                ds = [d for d in ds if not (isinstance(d, ToolCallDelta) and d.index > 0)]
            merged = deltas_to_openai(ds)
            c, tool_calls = merged.get("content", ""), merged.get("tool_calls", [])
            self.tool_deltas.extend(d for d in ds if isinstance(d, ToolCallDelta))
        delta: dict[str, Any] = {}
        if r and self.include_reasoning:
            self.reasoning.append(r)
            delta["reasoning_content"] = delta["reasoning"] = r
        if c:
            self.content.append(c)
            delta["content"] = c
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return delta

    def finish(self, reason: str | None, stop_reason: Any) -> str | None:
        if reason == "stop" and self.tp is not None and self.tp.num_tool_calls > 0:
            reason = "tool_calls"
        self.finish_reason, self.stop_reason = reason, stop_reason
        return reason

    def message(self) -> dict[str, Any]:
        reasoning = "".join(self.reasoning) if self.rp is not None and self.include_reasoning else ""
        content = "".join(self.content)
        calls = collect_tool_stream(self.tool_deltas)[1]
        msg: dict[str, Any] = {"role": "assistant", "content": None if (calls and not content) else content}
        if self.rp is not None:
            msg["reasoning_content"] = msg["reasoning"] = reasoning or None
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        return msg


class ChatHandler:
    def __init__(self, serving: Serving):
        self.s = serving

    def _prepare(self, req: ChatRequest):
        s = self.s
        parser = s.config.tool_call_parser
        if req.tool_choice == "auto" and not s.config.enable_auto_tool_choice:
            if req.tool_choice_given:  # vLLM's rule and message
                raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                               param="tool_choice")
            req.tool_choice = "none"  # tools without tool_choice: in the prompt, output not parsed (as vLLM)
        tools_on = req.tools is not None and req.tool_choice != "none"
        if tools_on and not parser:
            raise APIError(f"tool_choice {req.tool_choice!r} needs the server started with --tool-call-parser",
                           param="tool_choice")
        try:
            text = s.tokenizer.apply_chat_template(req.messages, tools=req.tools,
                                                   add_generation_prompt=req.add_generation_prompt,
                                                   tokenize=False, **req.chat_template_kwargs)
        except Exception as e:  # noqa: BLE001 - any template failure is the request's fault
            raise APIError(f"could not apply the chat template: {e}", param="messages") from None
        s.check_chars(text, param="messages")
        prefix = ""
        if tools_on and (req.named_tool or req.tool_choice == "required") and parser not in FORCEABLE_TOOL_PARSERS:
            raise APIError(f"tool_choice {req.tool_choice!r} is not supported with --tool-call-parser {parser} (only "
                           f"'auto' and 'none'; forced calls: {', '.join(FORCEABLE_TOOL_PARSERS)})",
                           param="tool_choice")
        if tools_on and (req.named_tool or req.tool_choice == "required"):
            head = "</think>\n\n" if prompt_opens_reasoning(text) else ""
            prefix = head + forced_tool_prefix(parser, req.named_tool)
            req.params = self._forced_call_params(req, parser)
        ids = s.tokenizer.encode(text + prefix, add_special_tokens=False)
        s.check_prompt(ids, req.params)
        if req.params.max_tokens is None and req.default_max_tokens is not None:  # vLLM: the default, to fit
            try:
                req.params = dataclasses.replace(req.params, max_tokens=min(req.default_max_tokens,
                                                                            s.max_model_len - len(ids)))
            except ValueError as e:
                raise APIError(f"{e} (max_tokens from the model's generation config)", param="max_tokens") from None
        rp_cls = get_reasoning_parser(s.config.reasoning_parser) if s.config.reasoning_parser else None
        tp_cls = get_tool_parser(parser) if tools_on else None
        keep = (rp_cls.special_tokens if rp_cls else ()) + (tp_cls.special_tokens if tp_cls else ())
        opens = prompt_opens_reasoning(text + prefix)
        so = req.params.structured_outputs
        if opens and rp_cls is not None and so is not None:  # the grammar holds the answer, not the reasoning
            end = s.tokenizer.convert_tokens_to_ids(THINK_END)
            if end is not None:
                req.params = dataclasses.replace(req.params, structured_outputs=dataclasses.replace(
                    so, after_token_id=end))
        choices = []
        for i in range(req.params.n):
            tp = tp_cls() if tp_cls else None
            pending = tp.feed(prefix[prefix.index(CALLS_BEGIN):]) if (tp and prefix) else []
            choices.append(_Choice(i, rp_cls(starts_in_reasoning=opens) if rp_cls else None, tp, pending,
                                   req.include_reasoning, bool(req.named_tool), req.parallel_tool_calls))
        return text + prefix, ids, keep, choices

    def _forced_call_params(self, req: ChatRequest, parser: str):
        """req.params with the grammar of a forced tool call (module docstring)."""
        from deepinfer_jax.text.grammar import check, tool_call_grammar

        if req.params.structured_outputs is not None:
            raise APIError(f"tool_choice {req.tool_choice!r} cannot be combined with response_format or guided "
                           "decoding fields", param="tool_choice")
        try:
            spec = StructuredOutputsParams(grammar=tool_call_grammar(
                req.tools, parser, self.s.tokenizer.convert_tokens_to_ids, named=req.named_tool,
                parallel=req.parallel_tool_calls))
            check(spec)
        except ValueError as e:
            raise APIError(f"the tools' parameters do not compile to a grammar: {e}", param="tools") from None
        return dataclasses.replace(req.params, structured_outputs=spec)

    async def __call__(self, request: web.Request, body: Any, ctx=None) -> web.StreamResponse:
        s = self.s
        req = parse_chat_request(body, s.config.sampling_defaults)
        model = s.check_model(req.model)
        s.check_available()
        s.check_sequences(req.params.n)
        prompt, ids, keep, choices = await s.offload(self._prepare, req)
        stream = s.submit(s.new_engine_id("chat"), ids, req.params, prompt, keep)
        cid, created = random_id("chatcmpl"), int(time.time())
        k = req.params.logprobs
        if req.stream:
            return await self._stream(request, req, stream, ids, choices, cid, created, model, k, ctx)
        cached, prompt_logprobs = 0, None
        try:
            async with aclosing(s.tracked(stream, len(ids))) as it:
                async for out in it:
                    cached = out.num_cached_tokens
                    prompt_logprobs = out.prompt_logprobs or prompt_logprobs
                    for c in out.outputs:
                        ch = choices[c.index]
                        final = c.finish_reason is not None
                        ch.feed(await s.delta(ctx, c.index, c.text, final), final)
                        ch.token_ids += c.token_ids
                        ch.logprobs += c.logprobs or []
                        if final:
                            ch.finish(c.finish_reason, c.stop_reason)
        except EngineStepError as e:
            raise APIError(str(e), 500, type="server_error", code="engine_error") from None
        except EngineNotReadyError as e:
            raise shutting_down(e) from None
        finally:
            stream.abort()

        def reply() -> dict:  # on a text thread: with logprobs a reply takes seconds to build (encode_reply)
            out_choices = [{"index": ch.index, "message": ch.message(),
                            "logprobs": chat_logprobs(ch.token_ids, ch.logprobs, k, s.token_str) if k is not None
                            else None, "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
                           for ch in choices]
            n_out = sum(len(ch.token_ids) for ch in choices)
            extra = {}
            if req.params.prompt_logprobs is not None:  # vLLM's field, beside the choices
                extra["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs, s.token_str)
            return envelope(cid, "chat.completion", model, created, choices=out_choices,
                            usage=usage(len(ids), n_out, cached), **extra)

        obj = await s.offload(reply)
        if ctx is not None and s.plugins.has("on_response"):
            obj = await s.plugins.on_response(ctx, obj)
        return json_response(request, obj, body=await s.offload(encode_reply, obj))

    async def _stream(self, request, req, stream, ids, choices, cid, created, model, k, ctx) -> web.StreamResponse:
        s = self.s
        sse = SSE(request)

        def chunk(chs: list, **extra) -> dict:
            if req.continuous_usage and "usage" not in extra:  # the tokens so far, in every chunk (vLLM)
                extra["usage"] = usage(len(ids), sum(len(ch.token_ids) for ch in choices), cached)
            return envelope(cid, "chat.completion.chunk", model, created, choices=chs, **extra)

        cached = 0
        try:
            await sse.start()
            for ch in choices:
                await sse.send(chunk([{"index": ch.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]))
                first = ch.feed("", False)
                if first:
                    await sse.send(chunk([{"index": ch.index, "delta": first, "logprobs": None,
                                           "finish_reason": None}]))
            async with aclosing(s.tracked(stream, len(ids))) as it:
                async for out in it:
                    cached = out.num_cached_tokens
                    for c in out.outputs:
                        ch = choices[c.index]
                        final = c.finish_reason is not None
                        delta = ch.feed(await s.delta(ctx, c.index, c.text, final), final)
                        ch.token_ids += c.token_ids
                        lp = None
                        if k is not None and c.logprobs:
                            lp = chat_logprobs(c.token_ids, c.logprobs, k, s.token_str)
                        if not (delta or lp or final):
                            continue
                        item = {"index": ch.index, "delta": delta, "logprobs": lp, "finish_reason": None}
                        if final:
                            item["finish_reason"] = ch.finish(c.finish_reason, c.stop_reason)
                            item["stop_reason"] = c.stop_reason
                        await sse.send(chunk([item]))
            if req.include_usage:
                n_out = sum(len(ch.token_ids) for ch in choices)
                await sse.send(chunk([], usage=usage(len(ids), n_out, cached)))
        except ConnectionResetError:
            return sse.resp  # the client left; tracked() aborted the request
        except (EngineStepError, EngineNotReadyError) as e:
            await send_error(sse, str(e), 503 if isinstance(e, EngineNotReadyError) else 500, s.metrics)
        except APIError as e:  # a plugin's failure, or a request the engine refused (400)
            await send_error(sse, e.message, e.status, s.metrics)
        except Exception as e:  # noqa: BLE001 - headers are out: report in-band
            log.exception("chat stream failed")
            await send_error(sse, f"internal error: {type(e).__name__}: {e}", 500, s.metrics)
        finally:
            stream.abort()
        try:
            return await sse.done()
        except ConnectionResetError:
            return sse.resp
