"""Engine-facing data types: SamplingParams, Request, and the outputs. Plain Python, no JAX.

Names follow vLLM (`vllm/sampling_params.py`, `vllm/v1/request.py`, `vllm/outputs.py`) so that code
and habits carry over.

Invariants:
- A `SamplingParams` is validated once in `__post_init__`; every rejection is a `ValueError` whose
  message starts with the offending field's name ("temperature must be ..., got -1"). After
  construction `stop` and `stop_token_ids` are lists (possibly empty), `top_k` is 0 when off.
- A `Request` is owned by the engine loop thread. `num_computed_tokens <= num_tokens` always;
  `num_tokens - num_computed_tokens` is the work left before the next token can be sampled.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
_TOKEN_ID_END = 2**31  # token ids and top_k go to the step as int32; no vocabulary is larger
MAX_LOGIT_BIAS = 300  # entries of SamplingParams.logit_bias (the width of the sampler's bias arrays)
_SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's convention)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's `RequestOutputKind`).

    CUMULATIVE: the whole text, token ids and logprobs so far, every step (copies grow with the output).
    DELTA: only what is new since the request's previous output; the host work a step stays O(1) in the
    output's length (the server streams these). FINAL_ONLY: one output, the whole of it, when the
    request finishes (`LLM.generate`)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's `StructuredOutputsParams`); exactly one field set.

    json: a JSON schema (a dict or its JSON text); json_object: True for any JSON object (OpenAI's JSON
    mode); regex: a regular expression (Rust `regex` syntax) the whole output matches; choice: a list of
    strings, the output is one of them; grammar: a Lark grammar or a GBNF (llama.cpp) grammar.

    The engine compiles it (llguidance, text/grammar.py) to a token-level matcher over the model's
    tokenizer; each step the sampler only draws tokens the matcher allows, EOS only where the grammar is
    complete, and the request finishes ("stop") when the grammar can take no more. JSON is generated in
    one fixed layout: no newlines or indentation, ", " between items and ": " after keys. A spec the
    compiler rejects is a ValueError naming the field (the server's 400).

    after_token_id: the grammar starts only after the output has this token (a reasoning model's end of
    thinking, `</think>`; the server sets it when the prompt opens reasoning and a reasoning parser is on);
    the tokens before it, that one included, are free. None: from the first output token."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    after_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.after_token_id is not None and (not _is_int(self.after_token_id) or self.after_token_id < 0):
            raise ValueError(f"structured_outputs.after_token_id must be a token id, got {self.after_token_id!r}")
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object, got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or a string), got {self.json!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """The field that is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs (vLLM names). Frozen; `stop` normalised to a list of strings.

    temperature 0 means greedy; top_k 0 or -1 means off (stored as 0); max_tokens None means "up to
    max_model_len" (the scheduler resolves it); logprobs None means none, 0 means only the sampled
    token's, k means the sampled token's plus the top k. min_tokens holds back EOS and
    stop_token_ids (the sampler should mask them; the scheduler never stops before min_tokens).
    structured_outputs: a StructuredOutputsParams (JSON schema, JSON object, regex, choice or grammar) the
    output is constrained to, as vLLM's field of that name; None for free text. logit_bias: {token id: bias}
    (OpenAI's: each bias in [-100, 100], added to that token's logit before penalties and sampling; at most
    MAX_LOGIT_BIAS entries); returned logprobs stay the model's own. prompt_logprobs: None, or k for each prompt
    token's logprob given the ones before it plus the top k (vLLM's field; the first token has none). best_of:
    sample best_of sequences and return the n with the highest cumulative logprob (OpenAI completions' field;
    above n, every output kind returns them once, at the end).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    best_of: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, what: str) -> ValueError:
            return ValueError(f"{name} must be {what}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not _is_num(self.temperature):
            raise bad("temperature", "a finite number")
        if self.temperature < 0:
            raise bad("temperature", "non-negative")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k < _TOKEN_ID_END:
            raise bad("top_k", f"-1 or 0 (off) or a positive integer below {_TOKEN_ID_END}")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "an integer or None")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise bad(name, "in [-2, 2]")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a positive number")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stop = list(stop)
        else:
            raise bad("stop", "a string, a list of strings or None")
        if any(s == "" for s in stop):
            raise bad("stop", "free of empty strings")
        object.__setattr__(self, "stop", stop)
        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif isinstance(ids, (list, tuple)) and all(_is_int(t) and 0 <= t < _TOKEN_ID_END for t in ids):
            ids = list(ids)
        else:
            raise bad("stop_token_ids", f"a list of token ids (integers in [0, {_TOKEN_ID_END})) or None")
        object.__setattr__(self, "stop_token_ids", ids)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None")
        if self.best_of is not None:
            if not _is_int(self.best_of) or self.best_of < self.n:
                raise bad("best_of", f"an integer >= n ({self.n}) or None")
        if not isinstance(self.output_kind, RequestOutputKind):
            if not _is_int(self.output_kind):
                raise bad("output_kind", "a RequestOutputKind")
            try:
                object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
            except ValueError:
                raise bad("output_kind", "a RequestOutputKind") from None
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "a StructuredOutputsParams or None")
        lb = self.logit_bias
        if lb is not None:
            if not isinstance(lb, dict) or not all(_is_int(k) and k >= 0 and _is_num(v) and -100 <= v <= 100
                                                   for k, v in lb.items()):
                raise bad("logit_bias", "a dict of token id (int >= 0) -> bias in [-100, 100]")
            if len(lb) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(lb)}")
            object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in lb.items()} or None)

    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0, up to vLLM's 1e-5 epsilon)."""
        return self.temperature < _SAMPLING_EPS


class RequestStatus(enum.IntEnum):
    """Life cycle: WAITING -> RUNNING <-> PREEMPTED (back in the waiting queue) -> FINISHED_*."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """One sequence being generated. Mutable; owned by the engine loop thread.

    `num_computed_tokens` counts tokens whose KV is in the cache (prompt and outputs alike; chunked
    prefill and decode are the same "catch up with num_tokens" motion). After a preemption it drops
    to 0 and prompt + outputs so far are recomputed. `num_cached_tokens` is the prefix-cache hit of
    the first schedule (what usage reports as cached prompt tokens). `stop_reason` is the matched
    stop token id or stop string; None for EOS, length and abort.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # The structured-output matcher (text/grammar.py GrammarMatcher) when sampling_params.structured_outputs is set:
    # the runner fills the step's token bitmask row from it, the engine advances it on each accepted token.
    grammar: Any = None
    # Speculative decoding: the drafts proposed for the tokens after the last one (set by the engine before each
    # schedule; the scheduler verifies as many as fit, and clears them once the step is applied).
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.eos_token_ids = tuple(self.eos_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs (a new list each call)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole concatenation."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """Finish reason: "stop", "length", "abort", or None while unfinished."""
        return self.status.finish_reason


@dataclass
class Logprob:
    """One candidate's log probability, its 1-based rank in the vocabulary, its text if decoded."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request (vLLM's CompletionOutput).

    `logprobs[i]` maps token id -> Logprob for output position i (the sampled token plus the top-k).
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the engine hands back per request per step (whole, new only, or final: SamplingParams.output_kind)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    finished: bool
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (no context); under DELTA
    # only in the request's first output.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
