"""Streaming detokenization with vLLM's prefix-offset / read-offset technique.

`IncrementalDetokenizer(tokenizer, prompt_ids=None, skip_special_tokens=True,
keep_special_tokens=())`: `add(ids)` returns the newly readable text, `flush()` the rest.

Invariants (tested with random id sequences):
- "".join(all add() results) + flush() == tokenizer.decode(output_ids, skip_special_tokens=...)
  when there is no prompt; with a prompt it equals the text that the output ids add to the
  decoded prompt (so a sentencepiece "▁word" keeps its leading space).
- add() never returns text ending in U+FFFD (half a UTF-8 character); such text is held until
  the character completes or flush() is called. Only flush() may emit a trailing U+FFFD (the
  stream really ended mid-character).
- Each step decodes only ids[prefix_offset:], a window that starts at the previous emission
  point and so stays a few tokens long: O(1) work per token unless a character is incomplete
  (the text emitted so far is kept in pieces, joined only when `text` is read).

Why it is exact: the text emitted so far is decode(ids[:read_offset]) and that text ends in a
complete character, so UTF-8 decoding restarts cleanly there; decoding the window
ids[prefix_offset:] and dropping decode(ids[prefix_offset:read_offset]) yields exactly the new
characters (prefix_offset, a previous read point, gives both decodes the same left context,
which also makes sentencepiece's first-piece space rule cancel out).
"""

from __future__ import annotations

from typing import Iterable

#: how many prompt tokens the first window reaches back (vLLM uses 5)
INITIAL_PREFIX_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated ids into text deltas for one request."""

    def __init__(self, tokenizer, prompt_ids: Iterable[int] | None = None,
                 skip_special_tokens: bool = True, keep_special_tokens: Iterable[str] = ()):
        self._tok = tokenizer
        self._skip = (tokenizer.skipped_ids(keep_special_tokens) if skip_special_tokens
                      else frozenset())
        self._ids: list[int] = [i for i in map(int, prompt_ids if prompt_ids is not None else ())
                                if i not in self._skip]
        self._read = len(self._ids)
        self._prefix = max(self._read - INITIAL_PREFIX_TOKENS, 0)
        self._pieces: list[str] = []  # everything emitted so far, joined on demand (`text`)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Append generated ids (an int, or any iterable of ints such as a NumPy array);
        return the text that became complete (maybe "")."""
        try:
            ids = iter(token_ids)  # type: ignore[arg-type]
        except TypeError:
            ids = iter((token_ids,))
        skip = self._skip
        before = len(self._ids)
        self._ids.extend(i for i in map(int, ids) if i not in skip)
        if len(self._ids) == before:
            return ""
        return self._step(final=False)

    def flush(self) -> str:
        """End of stream: return any held text, even an incomplete character (as U+FFFD)."""
        if self._read >= len(self._ids):
            return ""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        decode = self._tok.decode_filtered
        prefix_text = decode(self._ids[self._prefix:self._read])
        new_text = decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(_REPLACEMENT)):
            if final:
                self._prefix = self._read = len(self._ids)
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._pieces.append(delta)  # not `text += delta`: a copy of the whole text every token
        return delta

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) != 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0]
