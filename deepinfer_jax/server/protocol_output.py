"""OpenAI response shapes: the error (`APIError`, `error_body`), usage, the envelope, and logprobs in the chat and
completions forms. Plain Python: no JAX, no aiohttp (ARCHITECTURE rule 2)."""

from __future__ import annotations

import time
from typing import Any


class APIError(Exception):
    """An error returned to the client as {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def envelope(rid: str, obj: str, model: str, created: int | None = None, **rest: Any) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": int(time.time()) if created is None else created,
            "model": model, **rest}


def chat_logprobs(token_ids: list[int], entries: list[dict], k: int, token_str) -> dict[str, Any]:
    """OpenAI chat `logprobs` ({"content": [...]}) for the sampled ids and their Logprob dicts."""
    content = []
    for tid, entry in zip(token_ids, entries):
        s = token_str(tid)
        lp = entry[tid].logprob if tid in entry else float("nan")
        top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
        content.append({"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": token_str(t), "logprob": _finite(v.logprob),
                                          "bytes": list(token_str(t).encode("utf-8"))} for t, v in top]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], entries: list[dict], k: int, token_str,
                        text_offset: int = 0) -> dict[str, Any]:
    """OpenAI legacy completions `logprobs` (tokens / token_logprobs / top_logprobs / text_offset)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(token_ids, entries):
        s = token_str(tid)
        out["tokens"].append(s)
        out["token_logprobs"].append(_finite(entry[tid].logprob) if tid in entry else None)
        top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:max(k, 1)]
        out["top_logprobs"].append({token_str(t): _finite(v.logprob) for t, v in top})
        out["text_offset"].append(text_offset)
        text_offset += len(s)
    return out


def echo_logprobs(prompt_ids: list[int], entries: list[dict | None], k: int, token_str) -> dict[str, Any]:
    """`completion_logprobs` of an echoed prompt: the first token has no logprob (None, as OpenAI and vLLM
    report it); the others carry their prompt logprobs. Text offsets count the tokens' strings from 0, as vLLM's
    (special tokens such as BOS included, so they may run past the echoed text's own length)."""
    out = completion_logprobs(prompt_ids[1:], entries[1:], k, token_str, len(token_str(prompt_ids[0])))
    first = token_str(prompt_ids[0])
    return {"tokens": [first] + out["tokens"], "token_logprobs": [None] + out["token_logprobs"],
            "top_logprobs": [None] + out["top_logprobs"], "text_offset": [0] + out["text_offset"]}


def merge_logprobs(a: dict[str, list] | None, b: dict[str, list] | None) -> dict[str, list] | None:
    """Two `completion_logprobs` one after the other (b's text offsets already follow a's)."""
    if a is None or b is None:
        return a or b
    return {key: a[key] + b[key] for key in a}


def prompt_logprobs_json(entries: list[dict | None] | None, token_str) -> list | None:
    """vLLM's `prompt_logprobs` in a response: per prompt token None or {token id: {logprob, rank,
    decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": _finite(v.logprob), "rank": v.rank,
                                             "decoded_token": token_str(t)} for t, v in e.items()}
            for e in entries]


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number (vLLM clamps to -9999.0 the same way)
    return max(float(x), -9999.0) if x == x else -9999.0
