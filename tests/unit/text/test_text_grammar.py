"""Structured-output matchers on the host (text/grammar.py; no JAX): compiled over the embedded default model's
tokenizer, walked by random draws from their own packed bitmasks, the texts checked against the reference
(jsonschema, json, re, the choice list)."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import numpy as np
import pytest

from deepinfer_jax.text import load_tokenizer
from deepinfer_jax.text.grammar import GrammarCompiler, GrammarMatcher, allowed_ids, check, mask_words
from deepinfer_jax.types import SamplingParams, StructuredOutputsParams as SOP

ASSET = os.path.join(os.path.dirname(__file__), "..", "..", "..", "deepinfer_jax", "assets", "default-model")
with open(os.path.join(ASSET, "config.json")) as _f:
    VOCAB = json.load(_f)["vocab_size"]  # the default model's (at least its tokenizer's size)

SCHEMAS = [
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 999},
                                      "ok": {"type": "boolean"}}, "required": ["id", "ok"],
     "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "eel"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["kind", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "inner": {"type": "object", "properties": {
                                          "x": {"type": "number", "minimum": 0, "maximum": 1}},
                                          "required": ["x"], "additionalProperties": False}},
     "required": ["code", "inner"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ASSET)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, VOCAB, tok.eos_token_ids)


def _walk(tok, m: GrammarMatcher, rng, max_tokens: int = 200) -> tuple[str, bool]:
    """Draw tokens uniformly from the matcher's own mask until EOS or the grammar ends; (text, finished)."""
    ids = []
    for _ in range(max_tokens):
        allowed = m.allowed_ids()
        assert len(allowed) > 0
        eos = [t for t in allowed if t in tok.eos_token_ids]
        assert bool(eos) == m.is_accepting(), "EOS must be allowed exactly where the grammar is complete"
        # prefer stopping once possible half of the time, so that walks end
        t = int(eos[0]) if eos and rng.random() < 0.5 else int(rng.choice(allowed))
        if t in tok.eos_token_ids:
            return tok.decode(ids), True
        assert m.accept(t), m.error
        ids.append(t)
        if m.is_terminated():
            return tok.decode(ids), True
    return tok.decode(ids), False


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_walks_validate(tok, compiler, schema):
    rng = np.random.default_rng(0)
    done = 0
    for _ in range(12):
        text, finished = _walk(tok, compiler.matcher(SOP(json=schema)), rng)
        if finished:
            jsonschema.validate(json.loads(text), schema)
            done += 1
    assert done >= 10


def test_json_object_regex_choice_grammar(tok, compiler):
    rng = np.random.default_rng(1)
    for _ in range(5):
        text, finished = _walk(tok, compiler.matcher(SOP(json_object=True)), rng, 400)
        if finished:
            assert isinstance(json.loads(text), dict)
        text, finished = _walk(tok, compiler.matcher(SOP(regex=r"[0-9]{3}-[a-z]{2,4}")), rng)
        assert finished and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
        text, finished = _walk(tok, compiler.matcher(SOP(choice=["yes", "no", "maybe so"])), rng)
        assert finished and text in ("yes", "no", "maybe so")
        text, finished = _walk(tok, compiler.matcher(SOP(grammar='root ::= ("ab" | "cd")+ "!"')), rng)
        assert finished and re.fullmatch(r"(ab|cd)+!", text), text


def test_choice_first_token_mask(tok, compiler):
    m = compiler.matcher(SOP(choice=["yes", "no"]))
    first = {tok.decode([int(t)]) for t in m.allowed_ids()}
    assert first and all("yes".startswith(s) or "no".startswith(s) for s in first)
    assert not any(t in tok.eos_token_ids for t in m.allowed_ids())


def test_terminated_allows_only_eos_and_rollback(tok, compiler):
    m = compiler.matcher(SOP(choice=["no"]))
    ids = tok.encode("no", add_special_tokens=False)
    for t in ids:
        assert m.accept(t)
    assert m.is_terminated() and m.is_accepting()
    assert set(m.allowed_ids().tolist()) <= set(tok.eos_token_ids)
    m.rollback(len(ids))
    assert not m.is_terminated() and m.num_accepted == 0
    assert not m.accept(tok.encode("x", add_special_tokens=False)[0])  # forbidden: the matcher is in error
    assert m.error


def test_fill_bitmasks_rows(tok, compiler):
    """Several rows in one call; untouched rows keep their bits; a matcher in error allows only EOS."""
    a, b, bad = (compiler.matcher(SOP(choice=["yes"])), compiler.matcher(SOP(regex="[0-9]+")),
                 compiler.matcher(SOP(choice=["yes"])))
    bad.accept(tok.encode("no", add_special_tokens=False)[0])
    bits = np.full((4, mask_words(VOCAB)), -1, np.int32)
    GrammarMatcher.fill_bitmasks([(a, 0), (b, 2), (bad, 3)], bits)
    assert (bits[1] == -1).all()
    assert set(allowed_ids(bits[0], VOCAB).tolist()) == set(a.allowed_ids().tolist())
    digits = [tok.decode([int(t)]) for t in allowed_ids(bits[2], VOCAB)]
    assert digits and all(d.isdigit() for d in digits)
    assert set(allowed_ids(bits[3], VOCAB).tolist()) == set(tok.eos_token_ids)
    with pytest.raises(ValueError, match="words"):
        GrammarMatcher.fill_bitmasks([(a, 0)], np.zeros((1, 3), np.int32))


@pytest.mark.parametrize("spec,field", [
    (SOP(json={"type": "strin"}), "structured_outputs.json"),
    (SOP(json='{"type": '), "structured_outputs.json"),
    (SOP(regex="[a-"), "structured_outputs.regex"),
    (SOP(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_rejected_specs_name_the_field(compiler, spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        check(spec)
    with pytest.raises(ValueError, match=re.escape(field)):
        compiler.matcher(spec)


def test_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        SOP()
    with pytest.raises(ValueError, match="exactly one"):
        SOP(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        SOP(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.json"):
        SOP(json=3)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    assert SOP(json_object=True).kind == "json_object"
    assert SamplingParams(structured_outputs=SOP(regex="a")).structured_outputs.kind == "regex"


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
        "additionalProperties": False}}},
]


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31"])
@pytest.mark.parametrize("named", [None, "add"])
def test_tool_call_grammar_walks_parse(tok, compiler, parser, named):
    """Random walks of a forced tool call, after the chat handler's prefix, parse with the tool parser into
    calls of the given tools whose arguments follow their schemas."""
    from deepinfer_jax.text import get_tool_parser
    from deepinfer_jax.text.grammar import tool_call_grammar
    from deepinfer_jax.text.tool_parsers import CALL_BEGIN, CALLS_BEGIN, TOOL_SEP

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    v3 = parser == "deepseek_v3"
    prefix = CALLS_BEGIN + CALL_BEGIN + ("function" + TOOL_SEP if v3 else "")
    if named:
        prefix += named + ("\n```json\n" if v3 else TOOL_SEP)
    spec = SOP(grammar=tool_call_grammar(TOOLS, parser, tok.convert_tokens_to_ids, named=named, parallel=True))
    check(spec)
    rng = np.random.default_rng(3)
    for _ in range(6):
        m = compiler.matcher(spec)
        ids = []
        while not m.is_terminated() and len(ids) < 300:
            allowed = [int(t) for t in m.allowed_ids() if t not in tok.eos_token_ids]
            t = rng.choice(allowed)
            assert m.accept(t)
            ids.append(int(t))
        assert m.is_terminated()
        content, calls = get_tool_parser(parser)().extract(prefix + tok.decode(ids))
        assert not content.strip() and calls
        assert not named or [c.name for c in calls] == [named]
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])


def test_sentencepiece_tokenizer_is_refused(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(['hello world {"a": 1, "b": [2, 3]} 123-abc'] * 50))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=300,
                                   byte_fallback=True, model_type="bpe", bos_id=0, eos_id=1, unk_id=2,
                                   minloglevel=2)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    tok = load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="tokenizer.json"):
        GrammarCompiler(tok, 300, tok.eos_token_ids).matcher(SOP(regex="[0-9]+"))


def test_missing_llguidance_is_a_value_error_naming_it(tok, monkeypatch):
    """Without the llguidance package a compiler's tokenizer and every spec check raise a ValueError naming it
    (the engine then starts without structured output and refuses those requests), never an ImportError."""
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises ModuleNotFoundError
    with pytest.raises(ValueError, match="llguidance package"):
        GrammarCompiler(tok, VOCAB, tok.eos_token_ids).ll_tokenizer  # noqa: B018
    with pytest.raises(ValueError, match="llguidance package"):
        check(SOP(regex="[0-9]+"))


def test_after_token_gate_and_rollback(tok, compiler):
    gate = tok.eos_token_ids[0] + 5  # any id: the grammar starts after it
    m = compiler.matcher(SOP(choice=["no"], after_token_id=gate))
    assert m.waiting and len(m.allowed_ids()) == VOCAB and not m.is_accepting()
    for t in (100, 200, gate):
        assert m.accept(t)
    assert not m.waiting
    no = tok.encode("no", add_special_tokens=False)
    assert set(m.allowed_ids().tolist()) == set(compiler.matcher(SOP(choice=["no"])).allowed_ids().tolist())
    assert all(m.accept(t) for t in no) and m.is_terminated()
    m.rollback(len(no) + 1)  # over the gate: waiting again
    assert m.waiting and not m.is_terminated() and m.num_accepted == 0
    assert m.accept(gate) and all(m.accept(t) for t in no) and m.is_terminated()


def test_eos_ids_past_the_tokenizer_are_dropped(tok, compiler):
    """A model whose config names EOS ids past its tokenizer's table (random-weight presets, padded vocabularies)
    keeps structured output through the ids the tokenizer knows; with none of them known it is a clear error."""
    eos = tuple(tok.eos_token_ids)
    padded = GrammarCompiler(tok, VOCAB + 4096, eos + (VOCAB + 100,))
    m = padded.matcher(SOP(choice=["yes", "no"]))
    first = {tok.decode([int(t)]) for t in m.allowed_ids()}
    assert first and all("yes".startswith(t) or "no".startswith(t) for t in first)
    with pytest.raises(ValueError, match="EOS"):
        GrammarCompiler(tok, VOCAB + 4096, (VOCAB + 100,)).matcher(SOP(regex="[0-9]+"))
