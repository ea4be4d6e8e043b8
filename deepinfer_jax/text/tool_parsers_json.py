"""Tool-call parsers `hermes` (Qwen2.5 / Qwen3, Hermes), `llama3_json` (Llama 3.1+) and `deepseek_v4` (DeepSeek-V4's
DSML), vLLM's names and formats; each call is emitted whole once complete.

  hermes:      content <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call> (one block a call, any number)
  llama3_json: the whole output is the call(s): optional `<|python_tag|>`, then {"name": NAME, "parameters": {...}}
               (or "arguments"), several separated by ";". Output that does not start so is content.
  deepseek_v4: content <｜DSML｜tool_calls> then per call <｜DSML｜invoke name="NAME"> and its parameters
               <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>, </｜DSML｜invoke>, and
               </｜DSML｜tool_calls> (V3.2's invoke / parameter grammar in V4's block). The arguments are the JSON object
               of the parameters: a string="true" value as the string, a string="false" one decoded as JSON (kept as
               the string where it is not JSON; vLLM coerces it by the request's tool schema, which no parser here
               sees). Whitespace between calls is dropped, other text in the block is content; an invoke that does
               not parse, or is cut off by the end of the stream, is given back verbatim as content.

Same API and stream shape as text/tool_parsers.py (`feed`, `flush`, `extract`, `num_tool_calls`,
`special_tokens`). A call is emitted whole once it is complete: one ToolCallDelta with id, type and name, then one
with its arguments, which are the JSON object re-serialised (`json.dumps(..., ensure_ascii=False)`, as vLLM does),
since the model wrote them nested inside the call's own JSON. Content is streamed as it comes, except a suffix that
may still become `<tool_call>`, held until decided. A hermes block whose body is not a JSON object with a string
"name" is given back verbatim as content; so is llama3_json output that does not parse as calls. A hermes block cut
off by the end of the stream is parsed if it is complete JSON, else given back as content.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from .tool_parsers import random_call_id
from .types import ContentDelta, ToolCall, ToolCallDelta, ToolStreamDelta, collect_tool_stream

HERMES_BEGIN, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def _partial_suffix_len(text: str, token: str) -> int:
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


def _call_of(obj: Any, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class _JsonToolParser:
    special_tokens: tuple[str, ...] = ()

    def __init__(self, id_factory: Callable[[], str] | None = None):
        self._id_factory = id_factory or random_call_id
        self._buf = ""
        self._index = -1
        self._out: list[ToolStreamDelta] = []

    @property
    def num_tool_calls(self) -> int:
        return self._index + 1

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """Whole text -> (content, tool calls); does not touch this parser's stream state."""
        p = type(self)(id_factory=self._id_factory)
        return collect_tool_stream(p.feed(text) + p.flush())

    def _content(self, text: str) -> None:
        if text:
            self._out.append(ContentDelta(text))

    def _call(self, name: str, arguments: str) -> None:
        self._index += 1
        self._out.append(ToolCallDelta(self._index, id=self._id_factory(), type="function", name=name, arguments=""))
        if arguments:
            self._out.append(ToolCallDelta(self._index, arguments=arguments))

    def _take(self) -> list[ToolStreamDelta]:
        out, self._out = self._out, []
        return out

    def feed(self, delta_text: str) -> list[ToolStreamDelta]:
        """The deltas `delta_text` completes (subclasses scan `_buf` in `_run`)."""
        self._buf += delta_text
        self._run(final=False)
        return self._take()

    def _run(self, final: bool) -> None:
        raise NotImplementedError


class HermesToolParser(_JsonToolParser):
    special_tokens = (HERMES_BEGIN, HERMES_END)

    def __init__(self, id_factory: Callable[[], str] | None = None):
        super().__init__(id_factory)
        self._in_call = False

    def flush(self) -> list[ToolStreamDelta]:
        self._run(final=True)
        if self._in_call:  # cut off inside a block
            self._block(self._buf, closed=False)
        else:
            self._content(self._buf)
        self._buf, self._in_call = "", False
        return self._take()

    def _run(self, final: bool) -> None:
        while True:
            if not self._in_call:
                i = self._buf.find(HERMES_BEGIN)
                if i < 0:
                    keep = 0 if final else _partial_suffix_len(self._buf, HERMES_BEGIN)
                    self._content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._content(self._buf[:i])
                self._buf, self._in_call = self._buf[i + len(HERMES_BEGIN):], True
            j = self._buf.find(HERMES_END)
            if j < 0:
                return
            self._block(self._buf[:j], closed=True)
            self._buf, self._in_call = self._buf[j + len(HERMES_END):], False

    def _block(self, body: str, closed: bool) -> None:
        try:
            call = _call_of(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            self._content(HERMES_BEGIN + body + (HERMES_END if closed else ""))
        else:
            self._call(*call)


class Llama3JsonToolParser(_JsonToolParser):
    special_tokens = (PYTHON_TAG,)

    def __init__(self, id_factory: Callable[[], str] | None = None):
        super().__init__(id_factory)
        self._mode = None  # None: undecided, "content", "calls" (held until the end)

    def feed(self, delta_text: str) -> list[ToolStreamDelta]:
        self._buf += delta_text
        if self._mode is None:
            head = self._buf.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._mode = "calls"
            elif head and not PYTHON_TAG.startswith(head):
                self._mode = "content"
        if self._mode == "content":
            self._content(self._buf)
            self._buf = ""
        return self._take()

    def flush(self) -> list[ToolStreamDelta]:
        text, self._buf = self._buf, ""
        calls = self._parse(text) if self._mode == "calls" else None
        if calls is None:
            self._content(text)
        else:
            for c in calls:
                self._call(*c)
        self._mode = "content"
        return self._take()

    @staticmethod
    def _parse(text: str) -> list[tuple[str, str]] | None:
        s = text.strip()
        if s.startswith(PYTHON_TAG):
            s = s[len(PYTHON_TAG):].lstrip()
        dec, calls, i = json.JSONDecoder(), [], 0
        while i < len(s):
            try:
                obj, i = dec.raw_decode(s, i)
            except ValueError:
                return None
            call = _call_of(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            rest = s[i:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            i = len(s) - len(rest)
        return calls or None


DSML_CALLS_BEGIN, DSML_CALLS_END = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"
DSML_INVOKE, DSML_INVOKE_END = "<｜DSML｜invoke", "</｜DSML｜invoke>"
_DSML_INVOKE_RE = re.compile(r'<｜DSML｜invoke\s+name="([^"]+)"\s*>(.*?)</｜DSML｜invoke>', re.DOTALL)
_DSML_PARAM_RE = re.compile(
    r'<｜DSML｜parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>(.*?)</｜DSML｜parameter>', re.DOTALL)


def _dsml_value(raw: str, is_string: str) -> Any:
    if is_string == "true":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class DeepSeekV4ToolParser(_JsonToolParser):
    special_tokens = (DSML_CALLS_BEGIN, DSML_CALLS_END)

    def __init__(self, id_factory: Callable[[], str] | None = None):
        super().__init__(id_factory)
        self._in_block = False

    def flush(self) -> list[ToolStreamDelta]:
        self._run(final=True)
        if self._in_block:  # cut off in the block: a torn invoke is content, whitespace before it a gap
            k = self._buf.find(DSML_INVOKE)
            self._gap(self._buf if k < 0 else self._buf[:k])
            if k >= 0:
                self._content(self._buf[k:])
        else:
            self._content(self._buf)
        self._buf, self._in_block = "", False
        return self._take()

    def _gap(self, text: str) -> None:
        """Text inside the block between calls: content unless it is only whitespace."""
        if text.strip():
            self._content(text)

    def _run(self, final: bool) -> None:
        while True:
            buf = self._buf
            if not self._in_block:
                i = buf.find(DSML_CALLS_BEGIN)
                if i < 0:
                    keep = 0 if final else _partial_suffix_len(buf, DSML_CALLS_BEGIN)
                    self._content(buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    return
                self._content(buf[:i])
                self._buf, self._in_block = buf[i + len(DSML_CALLS_BEGIN):], True
                continue
            end, k = buf.find(DSML_CALLS_END), buf.find(DSML_INVOKE)
            if end >= 0 and (k < 0 or end < k):  # the block closes
                self._gap(buf[:end])
                self._buf, self._in_block = buf[end + len(DSML_CALLS_END):], False
                continue
            if k < 0:
                return  # held: the rest may still open a call or close the block
            e = buf.find(DSML_INVOKE_END, k)
            if e < 0:
                return
            self._gap(buf[:k])
            segment = buf[k: e + len(DSML_INVOKE_END)]
            m = _DSML_INVOKE_RE.fullmatch(segment)
            if m is None:
                self._content(segment)
            else:
                params = {key: _dsml_value(v, st) for key, st, v in _DSML_PARAM_RE.findall(m.group(2))}
                self._call(m.group(1), json.dumps(params, ensure_ascii=False))
            self._buf = buf[e + len(DSML_INVOKE_END):]
