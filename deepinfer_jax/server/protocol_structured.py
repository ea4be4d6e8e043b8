"""Structured output's request fields: OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}) and vLLM's `structured_outputs`, `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` become SamplingParams.structured_outputs, checked by the grammar compiler here
(text/grammar.py `check`), so a schema it rejects is a 400 naming the field. At most one of them per request; vLLM's
other guided options are refused by name. Plain Python: no JAX, no aiohttp (ARCHITECTURE rule 2)."""

from __future__ import annotations

from typing import Any

from deepinfer_jax.server.protocol_output import APIError
from deepinfer_jax.types import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM options beside the grammar: accepted only where they ask for what this server does anyway.
_GUIDED_OPTIONS = {"guided_decoding_backend": ("guidance", "llguidance", "auto"), "guided_whitespace_pattern": (),
                   "structural_tag": (), "guided_options_request": ()}


def _response_format(rf: Any) -> tuple[str, Any] | None:
    """OpenAI's response_format -> (StructuredOutputsParams field, value), or None for plain text."""
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise APIError("'response_format' must be an object with a string 'type'", param="response_format")
    kind = rf["type"]
    extra = sorted(set(rf) - {"type", "json_schema"} if kind == "json_schema" else set(rf) - {"type"})
    if extra and kind in ("text", "json_object", "json_schema"):
        raise APIError(f"response_format.{extra[0]} is not supported with type {kind!r}", param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str):
            raise APIError("response_format 'json_schema' must be {'name': ..., 'schema': {...}, 'strict': ...}",
                           param="response_format")
        extra = sorted(set(js) - {"name", "description", "schema", "strict"})
        if extra:
            raise APIError(f"response_format.json_schema.{extra[0]} is not supported (name, description, schema, "
                           "strict)", param="response_format")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise APIError(f"response_format.json_schema.strict must be a boolean, got {js['strict']!r}",
                           param="response_format")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise APIError(f"response_format.json_schema.schema must be an object, got {schema!r}",
                           param="response_format")
        return "json", schema
    raise APIError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format")


def structured_output(body: dict) -> StructuredOutputsParams | None:
    """The request's structured-output constraint (module docstring), compiled once to check it."""
    for name, ok in _GUIDED_OPTIONS.items():
        v = body.get(name)
        if v is not None and v not in ok:
            raise APIError(f"'{name}' is not supported", param=name)
    found: list[tuple[str, str, Any]] = []  # (request field, StructuredOutputsParams field, value)
    if body.get("response_format") is not None:
        rf = _response_format(body["response_format"])
        if rf is not None:
            found.append(("response_format", *rf))
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, key, body[name]))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise APIError("'structured_outputs' must be an object", param="structured_outputs")
        unknown = sorted(k for k, v in so.items() if k not in _SO_KEYS and v is not None)
        if unknown:
            raise APIError(f"structured_outputs.{unknown[0]} is not supported (supported: {', '.join(_SO_KEYS)})",
                           param="structured_outputs")
        given = [(k, v) for k, v in so.items() if v not in (None, False)]
        if len(given) != 1:
            raise APIError(f"'structured_outputs' must set exactly one of {', '.join(_SO_KEYS)}",
                           param="structured_outputs")
        found.append(("structured_outputs", *given[0]))
    if not found:
        return None
    if len(found) > 1:
        names = [f[0] for f in found]
        raise APIError(f"only one structured-output field may be given, got {', '.join(names)}", param=names[1])
    field_name, key, value = found[0]
    try:
        spec = StructuredOutputsParams(**{key: value})
        from deepinfer_jax.text.grammar import check

        check(spec)
    except ValueError as e:
        raise APIError(f"'{field_name}': {e}", param=field_name) from None
    return spec
