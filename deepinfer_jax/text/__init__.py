"""Text room: tokenizers, chat templates, streaming detokenization, stop strings, and the
reasoning / tool-call parsers (DeepSeek's, Hermes and Llama 3 JSON calls). Pure Python (tokenizers,
sentencepiece, jinja2); no JAX.

Typical server flow for one chat request (see README.md in this folder):
    tok = load_tokenizer(model_dir, chat_template=args.chat_template)
    prompt_ids = tok.apply_chat_template(messages, tools=tools, tokenize=True)
    reasoning = get_reasoning_parser("deepseek_r1")(prompt_opens_reasoning(prompt_text))
    tools_p = get_tool_parser("deepseek_v3")()
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=True,
                                   keep_special_tokens=reasoning.special_tokens + tools_p.special_tokens)
    stop = StopStringMatcher(stop_strings)
    for ids in engine_steps: text = stop.feed(detok.add(ids)); r, c = reasoning.feed(text); tools_p.feed(c) ...
"""

from __future__ import annotations

from .chat_template import ChatTemplateError, render_chat_template
from .builtin_templates import BUILTIN_TEMPLATES
from .detokenizer import IncrementalDetokenizer
from .reasoning import DeepSeekR1ReasoningParser, DeepSeekV4ReasoningParser, prompt_opens_reasoning
from .stop import StopChecker, StopStringMatcher, truncate_at_stop
from .tokenizer import Tokenizer, TokenizerNotFoundError, load_tokenizer
from .tool_parsers import DeepSeekV31ToolParser, DeepSeekV3ToolParser
from .tool_parsers_json import DeepSeekV4ToolParser, HermesToolParser, Llama3JsonToolParser
from .types import (ContentDelta, ToolCall, ToolCallDelta, ToolStreamDelta, collect_tool_stream,
                    deltas_to_openai)

# "deepseek_v3" is vLLM's name for V3.1 / V3.2 (thinking switched by the template's `thinking`) and "qwen3" Qwen3's
# `<think>`: the same rules, as the rendered prompt decides whether the output starts inside reasoning
# (`prompt_opens_reasoning`); "deepseek_v4" adds that a DSML tool-call block opened in reasoning ends it.
REASONING_PARSERS: dict[str, type] = {"deepseek_r1": DeepSeekR1ReasoningParser,
                                      "deepseek_v3": DeepSeekR1ReasoningParser, "qwen3": DeepSeekR1ReasoningParser,
                                      "deepseek_v4": DeepSeekV4ReasoningParser}
TOOL_PARSERS: dict[str, type] = {"deepseek_v3": DeepSeekV3ToolParser,
                                 "deepseek_v31": DeepSeekV31ToolParser, "deepseek_v4": DeepSeekV4ToolParser,
                                 "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
# Parsers whose calls `tool_choice` "required" or a named function can force (server/serving_chat.py).
FORCEABLE_TOOL_PARSERS = ("deepseek_v3", "deepseek_v31")


def _lookup(registry: dict[str, type], kind: str, name: str) -> type:
    try:
        return registry[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown {kind} parser {name!r}; valid: {', '.join(sorted(registry))}") from None


def get_reasoning_parser(name: str) -> type:
    """Reasoning parser class by name; ValueError lists the valid names."""
    return _lookup(REASONING_PARSERS, "reasoning", name)


def get_tool_parser(name: str) -> type:
    """Tool-call parser class by name; ValueError lists the valid names."""
    return _lookup(TOOL_PARSERS, "tool", name)


__all__ = [
    "BUILTIN_TEMPLATES", "ChatTemplateError", "ContentDelta", "DeepSeekR1ReasoningParser", "DeepSeekV4ReasoningParser",
    "DeepSeekV31ToolParser", "DeepSeekV3ToolParser", "DeepSeekV4ToolParser", "FORCEABLE_TOOL_PARSERS",
    "HermesToolParser",
    "IncrementalDetokenizer", "Llama3JsonToolParser",
    "REASONING_PARSERS", "StopChecker", "StopStringMatcher", "TOOL_PARSERS", "Tokenizer",
    "TokenizerNotFoundError", "ToolCall", "ToolCallDelta", "ToolStreamDelta",
    "collect_tool_stream", "deltas_to_openai", "get_reasoning_parser", "get_tool_parser",
    "load_tokenizer", "prompt_opens_reasoning", "render_chat_template", "truncate_at_stop",
]
