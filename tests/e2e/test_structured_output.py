"""Structured output through the live server and the official `openai` client: response_format json_schema /
json_object and vLLM's guided_* / structured_outputs fields, on the scripted checkpoint (whose own continuation
is no JSON at all, so every valid output is the grammar's doing). 200 generations under a mix of schemas all
validate with jsonschema; refusals are 400s naming the field. (No compiles after warm-up:
tests/engine/test_structured_llm.py, on an engine of its own.)"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from e2e_helpers import MODEL, wait_idle

MSG = [{"role": "user", "content": "Give me the data."}]

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}},
        "required": ["id", "email"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "minItems": 1, "maxItems": 4},
                                      "count": {"type": "integer", "minimum": -10, "maximum": 10}},
     "required": ["colors", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000},
                                      "currency": {"enum": ["EUR", "USD"]},
                                      "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
     "required": ["price", "currency", "sku"], "additionalProperties": False},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}},
     "required": ["points"], "additionalProperties": False},
]
N = 40  # choices a schema: 5 x 40 = 200 generations


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_outputs_validate(server, client, schema):
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, n=N, temperature=1.0, seed=7, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "data", "schema": schema, "strict": True}})
    assert len(r.choices) == N
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)
    wait_idle(server)


def test_json_object_and_stream(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, n=4, temperature=0.7, seed=1, max_tokens=200,
                                       response_format={"type": "json_object"})
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.finish_reason == "length"
    assert any(c.finish_reason == "stop" for c in r.choices)
    schema = SCHEMAS[2]
    parts, reasons = [], []
    for chunk in client.chat.completions.create(
            model=MODEL, messages=MSG, temperature=1.0, seed=3, max_tokens=120, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}):
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            reasons.append(ch.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads("".join(parts)), schema)


def test_guided_fields_completions_and_chat(client):
    choices = ["alpha", "beta", "gamma delta"]
    r = client.completions.create(model=MODEL, prompt="Pick one:", n=6, temperature=1.0, seed=5, max_tokens=20,
                                  extra_body={"guided_choice": choices})
    assert all(c.text in choices and c.finish_reason == "stop" for c in r.choices)
    pattern = r"[0-9]{3}-[a-z]{2,5}"
    r = client.chat.completions.create(model=MODEL, messages=MSG, n=4, temperature=1.0, seed=2, max_tokens=30,
                                       extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, c.message.content) for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="x", n=3, temperature=1.0, seed=4, max_tokens=60,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= ("ab" | "cd")+ "!"'}})
    assert all(re.fullmatch(r"(ab|cd)+!", c.text) for c in r.choices if c.finish_reason == "stop")
    r = client.completions.create(model=MODEL, prompt="x", temperature=0, max_tokens=40,
                                  extra_body={"guided_json": SCHEMAS[0]})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[0])


def test_pydantic_parse(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Item(BaseModel):  # bounded fields: greedy on the scripted weights would fill a free string forever
        label: str = Field(max_length=10)
        qty: int = Field(ge=0, le=100)
        size: Literal["S", "M", "L"]
        fragile: bool

    r = client.chat.completions.parse(model=MODEL, messages=MSG, response_format=Item, temperature=0.0,
                                      max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(c.message.parsed, Item)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(choice, names=tuple(SCHEMA_OF)):
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.tool_calls and not choice.message.content
    for call in choice.message.tool_calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_forced_tool_calls(client):
    """tool_choice "required" and a named function: always a call of a given tool with valid arguments, at any
    temperature, on weights that would never write one by themselves for these tools."""
    r = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required", n=8,
                                       temperature=1.0, seed=9, max_tokens=80, parallel_tool_calls=False)
    for c in r.choices:
        _check_calls(c)
        assert len(c.message.tool_calls) == 1
    r = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, n=6, temperature=1.0, seed=4,
                                       max_tokens=80, tool_choice={"type": "function", "function": {"name": "add"}})
    for c in r.choices:
        _check_calls(c, ("add",))
    calls: dict = {}
    reasons = []
    for chunk in client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                                                temperature=1.0, seed=2, max_tokens=100, stream=True):
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "args": ""})
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["args"] += (tc.function.arguments or "") if tc.function else ""
    assert reasons[-1] == "tool_calls" and calls
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["args"]), SCHEMA_OF[entry["name"]])


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_decoding_backend": "xgrammar", "guided_json": {}}, "guided_decoding_backend"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_refusals_in_openai_error_shape(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, extra_body=extra)
    assert e.value.status_code == 400
    err = e.value.body
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_logit_bias(client, tokenizer):
    """+100 on one token makes greedy decoding repeat it; -100 on the scripted continuation's first token moves
    greedy decoding off it."""
    [z] = tokenizer.encode("Z", add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0,
                                  logit_bias={str(z): 100})
    assert r.choices[0].text == "Z" * 6
    [first] = tokenizer.encode("<think>", add_special_tokens=False)
    plain, biased = (client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3, temperature=0,
                                                    logprobs=True, logit_bias=lb)
                     for lb in (None, {str(first): -100}))
    assert plain.choices[0].logprobs.content[0].token == "<think>"
    assert biased.choices[0].logprobs.content[0].token != "<think>"
