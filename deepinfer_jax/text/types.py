"""Plain result types of the text room (no JAX, no third-party imports).

Invariants:
- `ToolCall.arguments` is the argument text exactly as the model wrote it (fences and the
  surrounding whitespace removed); it is not re-serialised and not validated as JSON.
- A stream of `ToolCallDelta`s for one call starts with exactly one delta that carries `id`,
  `type` ("function") and `name` (and `arguments == ""`); every later delta for that index
  carries only an `arguments` fragment. Joining the fragments gives `ToolCall.arguments`.
- `ContentDelta.content` is never empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class ToolCall:
    """One complete tool call, as the non-streaming `extract` returns it."""

    id: str
    name: str
    arguments: str
    type: str = "function"

    def to_openai(self) -> dict[str, Any]:
        """OpenAI `message.tool_calls[i]` shape."""
        return {"id": self.id, "type": self.type,
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of tool call `index` (0-based, in order of appearance)."""

    index: int
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """OpenAI `delta.tool_calls[i]` shape; fields that are None are left out."""
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
        if self.type is not None:
            out["type"] = self.type
        fn: dict[str, Any] = {}
        if self.name is not None:
            fn["name"] = self.name
        if self.arguments is not None:
            fn["arguments"] = self.arguments
        if fn:
            out["function"] = fn
        return out


@dataclass(frozen=True)
class ContentDelta:
    """A streamed piece of plain assistant content."""

    content: str


ToolStreamDelta = Union[ContentDelta, ToolCallDelta]


def deltas_to_openai(deltas: list[ToolStreamDelta]) -> dict[str, Any]:
    """Merge one `feed()` result into a single OpenAI `choices[0].delta` dict.

    Content pieces are concatenated into "content"; tool-call pieces keep their order in
    "tool_calls". Returns {} when `deltas` is empty.
    """
    out: dict[str, Any] = {}
    content = "".join(d.content for d in deltas if isinstance(d, ContentDelta))
    if content:
        out["content"] = content
    calls = [d.to_openai() for d in deltas if isinstance(d, ToolCallDelta)]
    if calls:
        out["tool_calls"] = calls
    return out


def collect_tool_stream(deltas: list[ToolStreamDelta]) -> tuple[str, list[ToolCall]]:
    """Fold a whole stream of deltas back into (content, [ToolCall]) — what `extract` returns."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if isinstance(d, ContentDelta):
            content.append(d.content)
            continue
        c = calls.setdefault(d.index, {"id": "", "name": "", "type": "function", "arguments": []})
        if d.id is not None:
            c["id"] = d.id
        if d.name is not None:
            c["name"] = d.name
        if d.type is not None:
            c["type"] = d.type
        if d.arguments:
            c["arguments"].append(d.arguments)
    return "".join(content), [
        ToolCall(id=c["id"], name=c["name"], arguments="".join(c["arguments"]), type=c["type"])
        for _, c in sorted(calls.items())
    ]
