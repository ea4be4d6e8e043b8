"""Reasoning parser `deepseek_r1`: `<think>…</think>` -> reasoning_content, the rest -> content.

`DeepSeekR1ReasoningParser(starts_in_reasoning=True)`:
- whole text: `extract(text) -> (reasoning, content)`;
- streaming: `feed(delta) -> (reasoning_delta, content_delta)`, then `flush()` at the end.
`extract(text)` is by definition `feed(text)` followed by `flush()` on a fresh parser, so for
every split of a text into deltas the concatenated stream equals the whole-text result.

Rules:
- Output that begins with `<think>` (exactly at offset 0): the tag is dropped and what follows
  is reasoning until the first `</think>`; the tag is dropped and the rest is content.
- starts_in_reasoning=True (default, vLLM's behaviour for R1): the output is reasoning from its
  first character until `</think>`. This covers prompts that end with `<think>` (the later R1
  template), outputs with `</think>` but no `<think>`, and outputs cut off before `</think>`
  (then everything is reasoning and content is "").
- starts_in_reasoning=False (the prompt does not open reasoning, e.g. thinking disabled, or the
  January R1 template whose outputs begin with `<think>` themselves): output not starting with
  `<think>` is content, and a stray `</think>` in it stays content.
- After `</think>`, everything (including further tags) is content, verbatim.
- Streaming never emits part of a tag: a suffix that may still become `<think>` (at the start)
  or `</think>` (inside reasoning) is held until decided; flush() releases it as text.
Whitespace is kept verbatim (content after `</think>` usually starts with "\n\n").
Use `prompt_opens_reasoning(prompt_text)` to pick `starts_in_reasoning` from the prompt.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an open `<think>` (e.g. R1's `<think>\\n`)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_START)


def _partial_suffix_len(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


class DeepSeekR1ReasoningParser:
    """Splits one output stream into reasoning and content (see module docstring)."""

    #: token strings the detokenizer must keep for this parser to work
    special_tokens = (THINK_START, THINK_END)

    def __init__(self, starts_in_reasoning: bool = True):
        self.starts_in_reasoning = starts_in_reasoning
        self._state = _START
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether text fed now would still count as reasoning (False once content began)."""
        return self._state == _REASONING or (self._state == _START and self.starts_in_reasoning)

    @property
    def reasoning_ended(self) -> bool:
        """True once `</think>` was seen or the output turned out to be plain content."""
        return self._state == _CONTENT

    def feed(self, delta: str) -> tuple[str, str]:
        """Add text; return (reasoning_delta, content_delta), either possibly ""."""
        self._buf += delta
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self._buf
            if self._state == _START:
                if buf.startswith(THINK_START):
                    self._buf, self._state = buf[len(THINK_START):], _REASONING
                    continue
                if THINK_START.startswith(buf):  # empty, or may still become "<think>"
                    break
                self._state = _REASONING if self.starts_in_reasoning else _CONTENT
                continue
            if not (self._reasoning_step(buf, reasoning) if self._state == _REASONING
                    else self._content_step(buf, content)):
                break
        return "".join(reasoning), "".join(content)

    def _reasoning_step(self, buf: str, reasoning: list[str]) -> bool:
        """In reasoning: move what `buf` settles into `reasoning` (or the state on); True to scan on."""
        i = buf.find(THINK_END)
        if i >= 0:
            reasoning.append(buf[:i])
            self._buf, self._state = buf[i + len(THINK_END):], _CONTENT
            return True
        keep = _partial_suffix_len(buf, THINK_END)
        reasoning.append(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _content_step(self, buf: str, content: list[str]) -> bool:
        """In content: all of `buf` is content."""
        content.append(buf)
        self._buf = ""
        return False

    def flush(self) -> tuple[str, str]:
        """End of stream: release held text into the field it was held for."""
        held, self._buf = self._buf, ""
        if self._state == _START:
            self._state = _REASONING if self.starts_in_reasoning else _CONTENT
        if self._state == _REASONING:
            return held, ""
        return "", held

    def extract(self, text: str) -> tuple[str, str]:
        """Whole-text split -> (reasoning, content); does not touch this parser's stream state."""
        p = type(self)(starts_in_reasoning=self.starts_in_reasoning)
        r1, c1 = p.feed(text)
        r2, c2 = p.flush()
        return r1 + r2, c1 + c2


DSML_TOOL_CALLS = "<｜DSML｜tool_calls>"


class DeepSeekV4ReasoningParser(DeepSeekR1ReasoningParser):
    """`deepseek_v4` (vLLM's name): `deepseek_r1`'s rules, and a DSML tool-call block (`<｜DSML｜tool_calls>`) that
    starts inside reasoning ends it: the block and everything after it are content, except the `</think>` that
    would have closed the reasoning, which is dropped (the text is the same as vLLM's whole-output split)."""

    special_tokens = (THINK_START, THINK_END, DSML_TOOL_CALLS)

    def __init__(self, starts_in_reasoning: bool = True):
        super().__init__(starts_in_reasoning)
        self._drop_end = False  # after a tool block opened in reasoning: the first `</think>` is dropped

    def _reasoning_step(self, buf: str, reasoning: list[str]) -> bool:
        i, j = buf.find(THINK_END), buf.find(DSML_TOOL_CALLS)
        if j >= 0 and (i < 0 or j < i):  # the tool block comes first: it and what follows are content
            reasoning.append(buf[:j])
            self._buf, self._state, self._drop_end = buf[j:], _CONTENT, True
            return True
        if i >= 0:
            reasoning.append(buf[:i])
            self._buf, self._state = buf[i + len(THINK_END):], _CONTENT
            return True
        keep = max(_partial_suffix_len(buf, THINK_END), _partial_suffix_len(buf, DSML_TOOL_CALLS))
        reasoning.append(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False

    def _content_step(self, buf: str, content: list[str]) -> bool:
        if not self._drop_end:
            return super()._content_step(buf, content)
        i = buf.find(THINK_END)  # content owing the drop of one `</think>`
        if i >= 0:
            content.append(buf[:i] + buf[i + len(THINK_END):])
            self._buf, self._drop_end = "", False
            return False
        keep = _partial_suffix_len(buf, THINK_END)
        content.append(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False
