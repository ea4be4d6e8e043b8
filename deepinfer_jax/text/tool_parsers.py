"""Tool-call parsers `deepseek_v3` (V3/R1) and `deepseek_v31` (V3.1), whole-text and streaming.

Formats (between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, calls may be separated by
whitespace; text before, between-garbage and after is content):
  deepseek_v3:  <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
  deepseek_v31: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>

API: `feed(delta_text) -> list[ContentDelta | ToolCallDelta]`, `flush()` at end of stream,
`extract(text) -> (content, [ToolCall])`. `extract` is `feed(text) + flush()` on a fresh parser
(with the same id factory), so every split of a text into deltas folds
(`types.collect_tool_stream`) to the whole-text result.

Stream shape per call: one ToolCallDelta(index, id, type="function", name, arguments="") once the
name is complete, then ToolCallDelta(index, arguments=fragment)s. Content deltas come before
(and, for text after the block, after) the calls. A partial marker is never emitted as content:
a suffix that may still become a marker is held until decided.

Robustness rules (same in both modes):
- Begin and end markers may arrive in one delta (several calls in one delta too).
- `<｜tool▁call▁begin｜>` without the outer `<｜tool▁calls▁begin｜>` still opens a call.
- A call ends at `<｜tool▁call▁end｜>`, or implicitly at `<｜tool▁calls▁end｜>`, at the next
  `<｜tool▁call▁begin｜>`, or at the end of the stream (cut-off args are reported as they are).
- Malformed calls -- no `<｜tool▁sep｜>`, an empty or invalid name (allowed: letters, digits,
  `_ - . : /`), or no name after 256 characters -- are given back verbatim as content, from
  `<｜tool▁call▁begin｜>` through `<｜tool▁call▁end｜>` (the outer block markers are still
  consumed); no exception escapes.
- deepseek_v3 arguments: the fence line (```json) is dropped, and trailing whitespace plus a
  closing ``` fence are stripped. deepseek_v31 arguments are the raw text. JSON validity is not
  checked (as in vLLM); the client sees exactly what the model wrote.
"""

from __future__ import annotations

import re
import uuid
from typing import Callable

from .types import ContentDelta, ToolCall, ToolCallDelta, ToolStreamDelta, collect_tool_stream

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"

MAX_HEAD_CHARS = 256
_NAME_RE = re.compile(r"[\w\-.:/]+")
_MALFORMED = object()
_CONTENT, _BLOCK, _CALL = "content", "block", "call"
_CALL_TERMINATORS = (CALL_END, CALLS_END, CALL_BEGIN)
_MAX_TERM = max(map(len, _CALL_TERMINATORS))


def random_call_id() -> str:
    """OpenAI-style tool call id: "call_" + 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def _partial_suffix_len(text: str, tokens: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tokens`."""
    for n in range(min(len(text), max(map(len, tokens)) - 1), 0, -1):
        tail = text[-n:]
        if any(t.startswith(tail) for t in tokens):
            return n
    return 0


def _earliest(text: str, tokens: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    best = None
    for t in tokens:
        i = text.find(t, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, t)
    return best


class _DeepSeekToolParser:
    """Shared state machine; subclasses define the call head and argument cleaning."""

    #: token strings the detokenizer must keep for this parser to work
    special_tokens = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP)

    def __init__(self, id_factory: Callable[[], str] | None = None):
        self._id_factory = id_factory or random_call_id
        self._state = _CONTENT
        self._buf = ""          # unconsumed text in CONTENT / BLOCK
        self._body = ""         # text of the current call after <｜tool▁call▁begin｜>
        self._scan = 0          # where to look for call terminators in _body
        self._named = False     # name delta sent for the current call
        self._bad = False       # current call is malformed: its text goes to content
        self._args_start = 0
        self._args_sent = 0
        self._index = -1
        self._out: list[ToolStreamDelta] = []

    # -- subclass hooks ----------------------------------------------------------------------
    def _parse_head(self, body: str, final: bool):
        """(name, args_start) | None (need more text) | _MALFORMED."""
        raise NotImplementedError

    def _clean_args(self, region: str) -> str:
        return region

    def _safe_args_len(self, region: str) -> int:
        """How much of a still-open args region can be emitted now."""
        return len(region) - _partial_suffix_len(region, _CALL_TERMINATORS)

    # -- public API --------------------------------------------------------------------------
    @property
    def num_tool_calls(self) -> int:
        """Calls whose name was emitted so far (finish_reason "tool_calls" when > 0)."""
        return self._index + 1

    def feed(self, delta_text: str) -> list[ToolStreamDelta]:
        if self._state == _CALL:
            self._body += delta_text
        else:
            self._buf += delta_text
        self._run(final=False)
        out, self._out = self._out, []
        return out

    def flush(self) -> list[ToolStreamDelta]:
        self._run(final=True)
        if self._state == _CALL:
            self._finish_call("")
        elif self._state == _BLOCK and not self._buf.strip():
            self._buf = ""
        self._content(self._buf)
        self._buf, self._state = "", _CONTENT
        out, self._out = self._out, []
        return out

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """Whole text -> (content, tool calls); does not touch this parser's stream state."""
        p = type(self)(id_factory=self._id_factory)
        return collect_tool_stream(p.feed(text) + p.flush())

    # -- output helpers ----------------------------------------------------------------------
    def _content(self, text: str) -> None:
        if not text:
            return
        if self._out and isinstance(self._out[-1], ContentDelta):
            self._out[-1] = ContentDelta(self._out[-1].content + text)
        else:
            self._out.append(ContentDelta(text))

    def _args(self, text: str) -> None:
        if not text:
            return
        last = self._out[-1] if self._out else None
        if isinstance(last, ToolCallDelta) and last.index == self._index and last.name is None:
            self._out[-1] = ToolCallDelta(last.index, last.id, last.type, last.name,
                                          (last.arguments or "") + text)
        else:
            self._out.append(ToolCallDelta(self._index, arguments=text))

    # -- state machine -----------------------------------------------------------------------
    def _run(self, final: bool) -> None:
        while True:
            if self._state == _CONTENT:
                hit = _earliest(self._buf, (CALLS_BEGIN, CALL_BEGIN))
                if hit is None:
                    keep = 0 if final else _partial_suffix_len(self._buf, (CALLS_BEGIN, CALL_BEGIN))
                    self._content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                i, tok = hit
                self._content(self._buf[:i])
                rest, self._buf = self._buf[i + len(tok):], ""
                if tok == CALLS_BEGIN:
                    self._state, self._buf = _BLOCK, rest
                else:
                    self._open_call(rest)
            elif self._state == _BLOCK:
                s = self._buf.lstrip()
                if s.startswith(CALL_BEGIN):
                    self._buf = ""
                    self._open_call(s[len(CALL_BEGIN):])
                elif s.startswith(CALLS_END):
                    self._state, self._buf = _CONTENT, s[len(CALLS_END):]
                elif not s or (not final and (CALL_BEGIN.startswith(s) or CALLS_END.startswith(s))):
                    return  # whitespace between calls, or a marker still arriving
                else:
                    self._state = _CONTENT  # text inside the block is content
            else:
                hit = _earliest(self._body, _CALL_TERMINATORS, self._scan)
                if hit is None:
                    self._progress_call()
                    self._scan = max(0, len(self._body) - _MAX_TERM + 1)
                    return
                i, tok = hit
                rest = self._body[i + len(tok):]
                self._body = self._body[:i]
                self._finish_call(tok if tok == CALL_END else "")
                if tok == CALL_END:
                    self._state, self._buf = _BLOCK, rest
                elif tok == CALLS_END:
                    self._state, self._buf = _CONTENT, rest
                else:
                    self._open_call(rest)

    def _open_call(self, body: str) -> None:
        self._state, self._body, self._scan = _CALL, body, 0
        self._named, self._bad, self._args_start, self._args_sent = False, False, 0, 0

    def _name_call(self, head) -> None:
        name, self._args_start = head
        self._index += 1
        self._named = True
        self._out.append(ToolCallDelta(self._index, id=self._id_factory(), type="function",
                                       name=name, arguments=""))

    def _progress_call(self) -> None:
        if not self._named and not self._bad:
            head = self._parse_head(self._body, final=False)
            if head is None and len(self._body) > MAX_HEAD_CHARS:
                head = _MALFORMED
            if head is None:
                return
            if head is _MALFORMED:
                # give the call back verbatim as content, up to wherever it ends
                self._bad = True
                self._content(CALL_BEGIN)
            else:
                self._name_call(head)
        if self._bad:
            safe = len(self._body) - _partial_suffix_len(self._body, _CALL_TERMINATORS)
            self._content(self._body[:safe])
            self._body, self._scan = self._body[safe:], 0
            return
        region = self._body[self._args_start:]
        self._send_args(region[: self._safe_args_len(region)])

    def _finish_call(self, end_token: str) -> None:
        """The call body is complete (`end_token` is CALL_END or "" when implicit)."""
        if not self._named and not self._bad:
            head = self._parse_head(self._body, final=True)
            if head is _MALFORMED or head is None:
                self._bad = True
                self._content(CALL_BEGIN)
            else:
                self._name_call(head)
        if self._bad:
            self._content(self._body + end_token)
        else:
            self._send_args(self._clean_args(self._body[self._args_start:]))
        self._body, self._named, self._bad = "", False, False

    def _send_args(self, args: str) -> None:
        if len(args) > self._args_sent:
            self._args(args[self._args_sent:])
            self._args_sent = len(args)


class DeepSeekV3ToolParser(_DeepSeekToolParser):
    """V3/R1: `function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```` inside each call."""

    _OPEN_FENCES = ("```json\n", "```json", "```\n", "```")

    def _parse_head(self, body: str, final: bool):
        j = body.find(TOOL_SEP)
        if j < 0:
            return _MALFORMED if final else None
        kind = body[:j].strip()
        if len(kind) > 32 or "\n" in kind:
            return _MALFORMED
        after_sep = j + len(TOOL_SEP)
        nl = body.find("\n", after_sep)
        if nl < 0:
            if not final:
                return None
            name, args_start = body[after_sep:].strip(), len(body)
        else:
            name = body[after_sep:nl].strip()
            after = body[nl + 1:]
            if not final and len(after) < len(self._OPEN_FENCES[0]) and self._OPEN_FENCES[0].startswith(after):
                return None  # the ```json line may still be arriving
            fence = next((len(f) for f in self._OPEN_FENCES if after.startswith(f)), 0)
            args_start = nl + 1 + fence
        if not _NAME_RE.fullmatch(name):
            return _MALFORMED
        return name, args_start

    def _clean_args(self, region: str) -> str:
        s = region.rstrip()
        if s.endswith("```"):
            s = s[:-3].rstrip()
        return s

    def _safe_args_len(self, region: str) -> int:
        n = super()._safe_args_len(region)
        while n > 0 and region[n - 1] in " \t\r\n`":  # may be the closing fence
            n -= 1
        return n


class DeepSeekV31ToolParser(_DeepSeekToolParser):
    """V3.1: `NAME<｜tool▁sep｜>ARGS` inside each call, no type and no fences."""

    def _parse_head(self, body: str, final: bool):
        j = body.find(TOOL_SEP)
        if j < 0:
            return _MALFORMED if final else None
        name = body[:j].strip()
        if not _NAME_RE.fullmatch(name):
            return _MALFORMED
        return name, j + len(TOOL_SEP)
