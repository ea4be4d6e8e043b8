"""The engine's text-side state of a user request (`Parent`) and of each sequence sampled for it (`Child`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer_jax.types import Request


@dataclass
class Child:
    """Text-side state of one sampled sequence.

    `text_parts` holds the detokenized text in pieces (appending stays O(1) in the output's length):
    all of it, or under RequestOutputKind.DELTA only what is not yet returned. `sent_tokens` /
    `sent_logprobs` count the output tokens / logprob entries a DELTA output already returned."""

    request: Request
    index: int
    detok: Any = None
    stopper: Any = None
    text_parts: list[str] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0
    reported_finished: bool = False

    def take_text(self, delta: bool) -> str:
        """The text not yet returned (delta) or all of it, joined once."""
        parts = self.text_parts
        text = parts[0] if len(parts) == 1 else "".join(parts)
        if delta:
            parts.clear()
        elif len(parts) > 1:
            parts[:] = [text]
        return text


@dataclass
class Parent:
    """One user request: its children (n of them, or best_of), what to return of them (`n`; `hide_logprobs` when
    logprobs were computed only to rank best_of's sequences) and its prompt logprobs until they are returned."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Child] = field(default_factory=list)
    n: int = 1
    hide_logprobs: bool = False
    prompt_logprobs: list | None = None
