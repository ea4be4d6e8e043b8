"""Stop strings over a stream of text deltas.

`StopStringMatcher(stop, include_stop_str_in_output=False)`; `feed(delta) -> text to emit`,
`flush() -> held text` at the end; `.stopped` / `.matched` tell whether and which stop string hit.

Semantics (identical for every way of splitting the text into deltas, and equal to the
one-shot `truncate_at_stop(text, stop, include)`):
- The match is the occurrence that *completes first* (smallest end offset); among those
  ending at the same offset, the longest (earliest start). This is the first moment a
  streaming server can know a stop string occurred.
- Output is the text before the match (plus the stop string itself when
  include_stop_str_in_output). Nothing after the match is ever emitted; feeding after a stop
  returns "".
- Without include_stop_str_in_output, the longest suffix that could still begin a stop string
  is held back until decided, so a stop string is never partly emitted. With it, nothing
  needs holding back (a match only cuts what follows it).
- flush() after no match returns the held text; after a match it returns "".
"""

from __future__ import annotations

from typing import Sequence


def _find_first_completed(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """(start offset, stop) of the occurrence completing first at or after `start`."""
    best: tuple[int, int, str] | None = None  # (end, -len, stop)
    for s in stops:
        i = text.find(s, start)
        if i >= 0:
            key = (i + len(s), -len(s), s)
            if best is None or key < best:
                best = key
    if best is None:
        return None
    end, neg_len, s = best
    return end + neg_len, s


def truncate_at_stop(text: str, stop: Sequence[str],
                     include_stop_str_in_output: bool = False) -> tuple[str, str | None]:
    """Whole-text version: (text up to the stop, matched stop string or None)."""
    stops = [s for s in stop if s]
    hit = _find_first_completed(text, stops, 0)
    if hit is None:
        return text, None
    i, s = hit
    return text[: i + len(s)] if include_stop_str_in_output else text[:i], s


class StopStringMatcher:
    """Incremental stop-string matcher for one output stream.

    State: `_tail`, the last (longest stop - 1) characters seen, of which the last `_held`
    were not emitted yet. No complete stop string lies inside `_tail`, so a new match must
    end inside the new delta and the search covers only `_tail + delta`.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        self.stops = tuple(dict.fromkeys(s for s in stop if s))
        self.include = include_stop_str_in_output
        self._max = max((len(s) for s in self.stops), default=0)
        self._tail = ""
        self._held = 0
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Add text; return the part that is now safe to emit."""
        if self.stopped or not delta:
            return ""
        if not self.stops:
            return delta
        buf = self._tail + delta
        emitted_upto = len(self._tail) - self._held  # buf[emitted_upto:] is not emitted yet
        hit = _find_first_completed(buf, self.stops, 0)
        if hit is not None:
            i, s = hit
            self.stopped, self.matched, self._tail, self._held = True, s, "", 0
            return buf[emitted_upto: i + len(s) if self.include else max(i, emitted_upto)]
        keep = 0 if self.include else min(self._partial_suffix_len(buf), len(buf) - emitted_upto)
        self._held = keep
        self._tail = buf[max(0, len(buf) - (self._max - 1)):]
        return buf[emitted_upto: len(buf) - keep]

    def flush(self) -> str:
        """End of stream: release held text (nothing if a stop string matched)."""
        out = "" if self.stopped or not self._held else self._tail[len(self._tail) - self._held:]
        self._held = 0
        return out

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        for n in range(min(len(buf), self._max - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


StopChecker = StopStringMatcher
