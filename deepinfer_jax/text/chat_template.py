"""Chat-template rendering in Hugging Face's conventions, and the rule that picks a template.

Rendering (`render_chat_template`) matches transformers' `apply_chat_template`:
jinja2 `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
`loopcontrols` extension and a no-op `{% generation %}` tag; a `tojson` filter that is
`json.dumps(x, ensure_ascii=False, ...)`; globals `raise_exception(msg)` and
`strftime_now(fmt)`; variables `messages`, `tools`, `add_generation_prompt`, the special-token
strings (`bos_token`, `eos_token`, `pad_token`, `unk_token`) and every extra keyword (e.g.
`thinking=True`). A template error becomes `ChatTemplateError` (a ValueError), so a server can
answer 400.

Which template a model directory gets (`resolve_chat_template`), first match wins:
1. the user's template (server `--chat-template`): an existing file path is read; one of the
   built-in names ("deepseek_v2", "deepseek_v3", "deepseek_r1", "deepseek_v31") selects that template; any
   other string containing "{", "}" or a newline is the template text itself; anything else
   is an error (a mistyped path must not silently become a one-line template);
2. `chat_template.jinja` in the directory (HF >= 4.43 saves templates there; it wins over
   tokenizer_config.json, as in transformers);
3. `tokenizer_config.json` `chat_template`: a string, or a list of {name, template}, where
   "default" is used (and "tool_use", when present, for requests with tools);
   the directory's templates (2 and 3) are compiled when the tokenizer loads, so one that cannot compile stops the
   start with a line naming its file, not the first chat request;
4. a built-in template, chosen by
   a. a name hint: the directory's basename or config.json `_name_or_path` containing the
      word "r1" ("DeepSeek-R1", "R1-Distill", "deepseek_r1-0528") -> "deepseek_r1";
   b. config.json `model_type` "deepseek_v2" -> "deepseek_v2" (V2-Lite-Chat format), "deepseek_v32" or
      "deepseek_v4" -> "deepseek_v31" (V3.2 keeps V3.1's format; V4's checkpoints ship no jinja template, and the
      V3.1 turns stand in for its format: DSML tool calls are not rendered, docs/v4.md);
   c. `model_type` "deepseek_v3", or a vocabulary containing "<｜User｜>" -> "deepseek_v3";
   d. otherwise there is no template and `apply_chat_template` raises.
"""

from __future__ import annotations

import functools
import json
import os
import re
from datetime import datetime
from typing import Any, Mapping, Sequence

from .builtin_templates import BUILTIN_TEMPLATES


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render (including `raise_exception` calls)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=64)
def compile_chat_template(source: str):
    """Compile (and cache) a template with HF's environment. Raises ChatTemplateError."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(Extension):
        # HF's AssistantTracker marks assistant spans with {% generation %}; rendering is a no-op.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages, joining OpenAI text content parts into one string.

    DeepSeek models are text-only: a content list of {"type": "text", "text": ...} parts
    becomes the concatenated text; any other part type raises ChatTemplateError.
    """
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise ChatTemplateError(f"message {i} must be a mapping with a 'role'")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, Mapping) and part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                else:
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise ChatTemplateError(f"message {i}: content part {kind!r} is not supported "
                                            "(text-only model)")
            m["content"] = "".join(texts)
        out.append(m)
    return out


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], *,
                         tools: Sequence[Mapping[str, Any]] | None = None,
                         add_generation_prompt: bool = True,
                         special_tokens: Mapping[str, str | None] | None = None,
                         **kwargs: Any) -> str:
    """Render `source` exactly as transformers would (see module docstring)."""
    import jinja2

    template = compile_chat_template(source)
    variables: dict[str, Any] = dict(special_tokens or {})
    variables.update(kwargs)
    try:
        return template.render(messages=normalize_messages(messages),
                               tools=list(tools) if tools is not None else None,
                               add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e


_R1_HINT = re.compile(r"(?<![a-z0-9])r1(?![0-9])")


def builtin_template_name(model_dir: str | None, config: Mapping[str, Any] | None,
                          has_user_token: bool) -> str | None:
    """Rule 4 of the module docstring: which built-in template fits, or None."""
    config = config or {}
    hint = " ".join([os.path.basename(os.path.normpath(model_dir)) if model_dir else "",
                     str(config.get("_name_or_path") or "")]).lower()
    if _R1_HINT.search(hint):
        return "deepseek_r1"
    model_type = config.get("model_type")
    if model_type == "deepseek_v2":
        return "deepseek_v2"
    if model_type in ("deepseek_v32", "deepseek_v4"):
        return "deepseek_v31"
    if model_type == "deepseek_v3" or has_user_token:
        return "deepseek_v3"
    return None


def load_user_template(spec: str) -> tuple[str, str]:
    """Rule 1: resolve a `--chat-template` value to (template text, source description)."""
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            return f.read(), f"file:{spec}"
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec], f"builtin:{spec}"
    if any(c in spec for c in "{}\n"):
        return spec, "user-string"
    raise ChatTemplateError(
        f"--chat-template {spec!r} is neither an existing file, a built-in name "
        f"({', '.join(sorted(BUILTIN_TEMPLATES))}), nor Jinja template text")


def _model_templates(model_dir: str | None, tokenizer_config: Mapping[str, Any]
                     ) -> tuple[dict[str, str], str] | None:
    """The model directory's own templates (rules 2 and 3 of the module docstring) and their file, or None."""
    if model_dir:
        path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return {"default": f.read()}, "chat_template.jinja"
    ct = tokenizer_config.get("chat_template")
    if isinstance(ct, str) and ct:
        return {"default": ct}, "tokenizer_config.json"
    if isinstance(ct, list) and ct:
        named = {t["name"]: t["template"] for t in ct
                 if isinstance(t, Mapping) and "name" in t and "template" in t}
        if "default" not in named:
            raise ChatTemplateError("tokenizer_config.json chat_template list has no 'default' "
                                    f"entry (names: {sorted(named)})")
        return named, "tokenizer_config.json"
    return None


def resolve_chat_template(model_dir: str | None, tokenizer_config: Mapping[str, Any],
                          config: Mapping[str, Any] | None, user_template: str | None,
                          has_user_token: bool) -> tuple[dict[str, str], str | None]:
    """Apply the module-docstring rule. Returns ({name: template}, source) where the dict is
    empty when there is no template; "default" is the main entry."""
    if user_template is not None:  # compiled now: a template the user named that cannot compile stops the start
        text, source = load_user_template(user_template)
        try:
            compile_chat_template(text)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"--chat-template ({source}): {e}") from None
        return {"default": text}, source
    own = _model_templates(model_dir, tokenizer_config)
    if own is not None:  # compiled now too: a model's template that cannot compile stops the start, naming its file
        templates, source = own
        for key, text in templates.items():
            try:
                compile_chat_template(text)
            except ChatTemplateError as e:
                where = os.path.join(model_dir, source) if model_dir else source
                entry = "" if source == "chat_template.jinja" else (
                    " chat_template" + ("" if len(templates) == 1 and key == "default" else f" {key!r}"))
                raise ChatTemplateError(f"{where}{entry}: {str(e).rstrip('.')}; pass one that compiles with "
                                        "--chat-template") from None
        return own
    name = builtin_template_name(model_dir, config, has_user_token)
    if name is None:
        return {}, None
    return {"default": BUILTIN_TEMPLATES[name]}, f"builtin:{name}"
