"""OpenAI request parsing (the response shapes are protocol_output.py's). Plain Python: no JAX, no aiohttp
(ARCHITECTURE rule 2).

Parsing turns a decoded JSON body into a `ChatRequest` / `CompletionRequest` holding validated fields
and a `SamplingParams`; every rejection is an `APIError` (status 400 unless said otherwise) whose
`param` names the offending field. A field the parser does not read is refused by name (`_Seen`): nothing a
client sends is silently dropped, except the request tags in `_TAGS`, which change nothing computed. Nested
keys too: stream_options and response_format keys are checked, and each message (`_check_message`); a message's
`name` (handed to the template, which DeepSeek's ignore) and json_schema's `description` are accepted and change
nothing, as in vLLM. Field names and defaults
follow OpenAI, with vLLM's extras (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens, include_stop_str_in_output, include_reasoning,
chat_template_kwargs). Defaults: chat max_tokens = what fits in max_model_len, completions 16; the model's
generation_config.json (text/generation_config.py, --generation-config) may set other defaults, as in vLLM.

Structured output (`structured_output`, protocol_structured.py): response_format, structured_outputs and vLLM's
guided_* fields become SamplingParams.structured_outputs, a schema the grammar compiler rejects a 400 naming the
field.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from deepinfer_jax.server.protocol_output import (APIError, chat_logprobs, completion_logprobs,  # noqa: F401
                                                  echo_logprobs, envelope, error_body, merge_logprobs,
                                                  prompt_logprobs_json, usage)
from deepinfer_jax.server.protocol_structured import structured_output
from deepinfer_jax.text.generation_config import SamplingDefaults
from deepinfer_jax.types import MAX_LOGPROBS, SamplingParams

MAX_N = 128
_ROLES = ("system", "developer", "user", "assistant", "tool")
_SEED_MOD = 1 << 63  # the engine derives child seeds as seed + i; keep them inside uint64


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- field readers -------------------------------------------------------------------------------
class _Seen(dict):
    """A request body that records which fields the parser read, so that the rest can be refused by name."""

    def __init__(self, body: dict):
        super().__init__(body)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


# Fields that tag a request (for the client's own bookkeeping) and change nothing it computes: accepted when of
# their type. And fields accepted only at the value that asks for what this server does anyway.
_TAGS = {"user": (str,), "safety_identifier": (str,), "prompt_cache_key": (str,), "metadata": (dict,)}
_DEFAULT_ONLY = {"store": (False,), "service_tier": ("auto", "default"), "modalities": (["text"],)}


def _refuse_unread(body: _Seen) -> None:
    """400 naming the first field (non-null) that the parser did not read and that is not a tag."""
    for key, kinds in _TAGS.items():
        _opt(body, key, kinds, "a string" if kinds == (str,) else "an object")
    unread = sorted(k for k, v in body.items() if v is not None and k not in body.read
                    and k not in _TAGS and v not in _DEFAULT_ONLY.get(k, ()))
    if unread:
        more = f" (nor {', '.join(repr(k) for k in unread[1:])})" if len(unread) > 1 else ""
        raise APIError(f"'{unread[0]}' is not supported by this server{more}", param=unread[0])


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _opt(body: dict, key: str, kinds: tuple, what: str, default: Any = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        raise APIError(f"'{key}' must be {what}, got {v!r}", param=key)
    return v


_NUM = (int, float)


def _logit_bias(lb: Any) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}, ids as strings in JSON) -> {int: bias}; the range checks are
    SamplingParams' (400 naming logit_bias), the vocabulary's Serving.check_prompt's."""
    if lb is None or lb == {}:
        return None
    err = APIError("'logit_bias' must map token ids to numbers in [-100, 100]", param="logit_bias")
    if not isinstance(lb, dict):
        raise err
    out = {}
    for k, v in lb.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise err from None
        if not isinstance(v, _NUM) or isinstance(v, bool):
            raise err
        out[tid] = v
    return out


@dataclass
class _Common:
    model: str | None
    stream: bool
    include_usage: bool
    params: SamplingParams
    request_id: str | None = None
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage in every chunk


def _sampling(body: dict, *, n_default: int = 1, max_tokens_default: int | None, logprobs: int | None,
              max_tokens_key: str = "max_tokens", best_of: int | None = None,
              prompt_logprobs: int | None = None, defaults: SamplingDefaults | None = None) -> SamplingParams:
    """Build SamplingParams from OpenAI/vLLM fields; SamplingParams' ValueError -> 400 naming the field.
    `defaults` (--generation-config) fill the sampling fields the body does not set, and may cap max_tokens."""
    d = defaults.values if defaults is not None else {}
    n = _opt(body, "n", (int,), "an integer", n_default)
    if _is_int(n) and n > MAX_N:
        raise APIError(f"'n' must be at most {MAX_N}, got {n}", param="n")
    max_tokens = _opt(body, max_tokens_key, (int,), "an integer", None)
    if max_tokens is None and max_tokens_key != "max_tokens":
        max_tokens = _opt(body, "max_tokens", (int,), "an integer", None)
    if max_tokens is None:
        max_tokens = max_tokens_default
    cap = defaults.max_tokens_cap if defaults is not None else None
    if cap is not None and max_tokens is not None:
        max_tokens = min(max_tokens, cap)
    seed = _opt(body, "seed", (int,), "an integer", None)
    if seed is not None:
        if not -(1 << 63) <= seed < (1 << 64):
            raise APIError(f"'seed' must fit in 64 bits, got {seed}", param="seed")
        seed %= _SEED_MOD
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise APIError(f"'stop' must be a string or a list of strings, got {stop!r}", param="stop")
    kw = dict(
        n=n,
        temperature=_opt(body, "temperature", _NUM, "a number", d.get("temperature", 1.0)),
        top_p=_opt(body, "top_p", _NUM, "a number", d.get("top_p", 1.0)),
        top_k=_opt(body, "top_k", (int,), "an integer", d.get("top_k", 0)),
        min_p=_opt(body, "min_p", _NUM, "a number", d.get("min_p", 0.0)),
        seed=seed,
        presence_penalty=_opt(body, "presence_penalty", _NUM, "a number", 0.0),
        frequency_penalty=_opt(body, "frequency_penalty", _NUM, "a number", 0.0),
        repetition_penalty=_opt(body, "repetition_penalty", _NUM, "a number", d.get("repetition_penalty", 1.0)),
        max_tokens=max_tokens,
        min_tokens=_opt(body, "min_tokens", (int,), "an integer", 0),
        stop=stop,
        stop_token_ids=body.get("stop_token_ids"),
        include_stop_str_in_output=_opt(body, "include_stop_str_in_output", (bool,), "a boolean", False),
        ignore_eos=_opt(body, "ignore_eos", (bool,), "a boolean", False),
        logprobs=logprobs,
        skip_special_tokens=_opt(body, "skip_special_tokens", (bool,), "a boolean", True),
        structured_outputs=structured_output(body),
        logit_bias=_logit_bias(body.get("logit_bias")),
        prompt_logprobs=_opt(body, "prompt_logprobs", (int,), "an integer", prompt_logprobs),
        best_of=best_of,
    )
    if kw["prompt_logprobs"] is not None and prompt_logprobs is None and body.get("stream") is True:
        raise APIError("'prompt_logprobs' is not available when 'stream' is true", param="prompt_logprobs")
    if kw["temperature"] > 2.0:
        raise APIError(f"'temperature' must be in [0, 2], got {kw['temperature']}", param="temperature")
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        name = msg.split(" ", 1)[0]
        param = name if name in kw else None
        if param == "max_tokens" and max_tokens_key != "max_tokens" and body.get(max_tokens_key) is not None:
            param = max_tokens_key
        raise APIError(msg, param=param) from None


def _common(body: Any, params_fn) -> tuple[dict, _Common]:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    model = _opt(body, "model", (str,), "a string", None)
    stream = _opt(body, "stream", (bool,), "a boolean", False)
    so = _opt(body, "stream_options", (dict,), "an object", {})
    include_usage = _opt(so, "include_usage", (bool,), "a boolean", False)
    if so and not stream:
        raise APIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    continuous = _opt(so, "continuous_usage_stats", (bool,), "a boolean", False)
    if continuous and not include_usage:
        raise APIError("stream_options.continuous_usage_stats needs include_usage", param="stream_options")
    for key, v in so.items():
        if key in ("include_usage", "continuous_usage_stats") or v is None or (
                key == "include_obfuscation" and v is False):
            continue  # OpenAI's obfuscation pads chunks against length side channels; this server sends none
        also = ", and include_obfuscation false" if key == "include_obfuscation" else ""
        raise APIError(f"stream_options.{key} is not supported by this server (only include_usage, "
                       f"continuous_usage_stats{also})", param="stream_options")
    return body, _Common(model, stream, include_usage, params_fn(body), continuous_usage=continuous)


# ---- chat ----------------------------------------------------------------------------------------
# Keywords the chat template is rendered with by the server (Tokenizer.apply_chat_template): not for
# chat_template_kwargs; the first three are the request's own fields.
_REQUEST_ARGS = {"messages", "tools", "add_generation_prompt"}
_TEMPLATE_ARGS = _REQUEST_ARGS | {"tokenize", "special_tokens", "source"}


def _check_message(i: int, m: Any) -> None:
    """400 for a message OpenAI refuses: no string role, an unknown role, content missing (only an assistant
    message may go without), content neither a string nor a list of parts, a text part without string text, a
    name that is not a string, tool_calls without a function name and arguments."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(f"messages[{i}] must be an object with a string 'role'", param="messages")
    role = m["role"]
    if role not in _ROLES:
        raise APIError(f"messages[{i}].role must be one of {list(_ROLES)}, got {role!r}", param="messages")
    content = m.get("content")
    if content is None and role != "assistant":
        raise APIError(f"messages[{i}] (role {role!r}) needs 'content'", param="messages")
    if content is not None and not isinstance(content, (str, list)):
        raise APIError(f"messages[{i}].content must be a string, a list of parts or null", param="messages")
    for j, part in enumerate(content if isinstance(content, list) else ()):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise APIError(f"messages[{i}].content[{j}] must be an object with a string 'type'", param="messages")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise APIError(f"messages[{i}].content[{j}] (a text part) needs a string 'text'", param="messages")
    if m.get("name") is not None and not isinstance(m["name"], str):
        raise APIError(f"messages[{i}].name must be a string", param="messages")
    calls = m.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments"), (str, dict)) for c in calls)):
        raise APIError(f"messages[{i}].tool_calls must be a list of {{'function': {{'name': ..., 'arguments': ...}}}}",
                       param="messages")


@dataclass
class ChatRequest(_Common):
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    tool_choice: str | dict = "none"
    tool_choice_given: bool = False  # sent by the client (not the default from 'tools')
    named_tool: str | None = None
    parallel_tool_calls: bool = True
    top_logprobs: int | None = None
    include_reasoning: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)
    default_max_tokens: int | None = None  # --generation-config's, for a request without max_tokens (capped to fit)


def parse_chat_request(body: Any, defaults: SamplingDefaults | None = None) -> ChatRequest:
    if isinstance(body, dict):
        body = _Seen(body)
        body.get("max_tokens")  # chat reads max_completion_tokens first, then this
        lp = _opt(body, "logprobs", (bool,), "a boolean", False)
        top = _opt(body, "top_logprobs", (int,), "an integer", None)
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs")
        if top is not None and top > 0 and not lp:
            raise APIError("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    body, c = _common(body, lambda b: _sampling(
        b, max_tokens_default=None, max_tokens_key="max_completion_tokens", defaults=defaults,
        logprobs=(b.get("top_logprobs") or 0) if b.get("logprobs") else None))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    clean = []
    for i, m in enumerate(messages):
        _check_message(i, m)
        m = dict(m)
        if m["role"] == "developer":
            m["role"] = "system"
        if m.get("reasoning_content") is None and m.get("reasoning") is not None:
            m["reasoning_content"] = m["reasoning"]
        clean.append(m)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) and t["function"]["name"] for t in tools):
            raise APIError("'tools' must be a list of {'type': 'function', 'function': {'name': ...}}", param="tools")
        names = [t["function"]["name"] for t in tools]
        for t in tools:
            params = t["function"].get("parameters")
            if params is not None and not isinstance(params, dict):
                raise APIError(f"tools: function {t['function']['name']!r}: 'parameters' must be a JSON schema "
                               f"object, got {params!r}", param="tools")
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise APIError(f"tools: function {dup!r} is given more than once", param="tools")
        tools = tools or None
    choice = body.get("tool_choice")
    given = choice is not None
    named = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                           param="tool_choice")
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) and \
            isinstance(choice["function"].get("name"), str):
        named = choice["function"]["name"]
        if not tools or named not in [t["function"]["name"] for t in tools]:
            raise APIError(f"tool_choice names function {named!r}, which is not in 'tools'", param="tool_choice")
    else:
        raise APIError("'tool_choice' must be a string or {'type': 'function', 'function': {'name': ...}}",
                       param="tool_choice")
    if choice == "required" and not tools:
        raise APIError("tool_choice 'required' needs 'tools'", param="tool_choice")
    kwargs = _opt(body, "chat_template_kwargs", (dict,), "an object", {})
    taken = sorted(set(kwargs) & _TEMPLATE_ARGS)
    if taken:
        own = f" (send the request's own '{taken[0]}' field)" if taken[0] in _REQUEST_ARGS else ""
        raise APIError(f"chat_template_kwargs.{taken[0]} is set by the server{own}", param="chat_template_kwargs")
    parallel = _opt(body, "parallel_tool_calls", (bool,), "a boolean", True)
    include_reasoning = _opt(body, "include_reasoning", (bool,), "a boolean", True)
    add_generation_prompt = _opt(body, "add_generation_prompt", (bool,), "a boolean", True)
    _refuse_unread(body)
    return ChatRequest(
        c.model, c.stream, c.include_usage, c.params, messages=clean, tools=tools, tool_choice=choice,
        tool_choice_given=given,
        named_tool=named, top_logprobs=c.params.logprobs,
        parallel_tool_calls=parallel, include_reasoning=include_reasoning,
        add_generation_prompt=add_generation_prompt, chat_template_kwargs=dict(kwargs),
        continuous_usage=c.continuous_usage,
        default_max_tokens=(defaults.values.get("max_tokens") if defaults is not None else None))


# ---- completions ---------------------------------------------------------------------------------
@dataclass
class CompletionRequest(_Common):
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False


def parse_completion_request(body: Any, defaults: SamplingDefaults | None = None) -> CompletionRequest:
    if isinstance(body, dict):
        body = _Seen(body)
        lp = body.get("logprobs")
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise APIError(f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {lp!r}", param="logprobs")
        best_of = _opt(body, "best_of", (int,), "an integer", None)
        if best_of is not None and best_of > MAX_N:
            raise APIError(f"'best_of' must be at most {MAX_N}, got {best_of}", param="best_of")
        n = body.get("n", 1)
        if _is_int(best_of) and _is_int(n) and best_of > n and body.get("stream") is True:
            raise APIError("'best_of' above 'n' cannot be streamed", param="best_of")
        if body.get("suffix") not in (None, ""):  # an empty suffix asks for nothing
            raise APIError("'suffix' is not supported (no fill-in-the-middle)", param="suffix")
        # echo with logprobs: the prompt's tokens get their logprobs too (prompt logprobs, with the same k).
        echo_lp = lp if body.get("echo") is True else None
    else:
        best_of = echo_lp = None
    body, c = _common(body, lambda b: _sampling(b, max_tokens_default=16, logprobs=b.get("logprobs"),
                                                best_of=best_of, prompt_logprobs=echo_lp, defaults=defaults))
    echo = _opt(body, "echo", (bool,), "a boolean", False)
    prompts = parse_prompt(body.get("prompt"))
    _refuse_unread(body)
    return CompletionRequest(c.model, c.stream, c.include_usage, c.params, prompts=prompts, echo=echo,
                             continuous_usage=c.continuous_usage)


def parse_prompt(p: Any) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    err = APIError("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                   "token-id lists", param="prompt")
    if isinstance(p, str):
        prompts: list = [p]
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        prompts = [list(p)]
    elif isinstance(p, list) and p and all(isinstance(s, str) for s in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(isinstance(s, list) and s and all(_is_int(t) for t in s) for s in p):
        prompts = [list(s) for s in p]
    else:
        raise err
    if any(x == "" for x in prompts):
        raise APIError("'prompt' must not be empty", param="prompt")
    return prompts
