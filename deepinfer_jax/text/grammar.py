"""Structured output: a StructuredOutputsParams compiled to a token-level matcher over the model's tokenizer.

The grammar engine is llguidance (pinned in pyproject.toml): it compiles JSON schema, regex, a choice list and
Lark / GBNF grammars, and fills a packed bitmask of the allowed next tokens on the host (one bit a token,
`mask_words(vocab)` int32 words a row, bit t % 32 of word t // 32). It needs neither torch nor transformers.

    compiler = GrammarCompiler(tokenizer, vocab_size=cfg.vocab_size, eos_token_ids=(1,))
    m = compiler.matcher(StructuredOutputsParams(json={"type": "object"}))
    GrammarMatcher.fill_bitmasks([(m, 0)], bits)      # bits: int32 [rows, mask_words(vocab)]
    m.accept(token_id); m.is_terminated()             # after each sampled token

EOS is allowed only where the grammar is complete; `is_terminated()` is true once the grammar can take nothing
but EOS (the engine then finishes the request). `rollback(n)` undoes the last n accepted tokens (speculative
decoding's rejected drafts). JSON comes out in one layout (`JSON_OPTIONS`): no free whitespace, which a weak
model would otherwise fill without end.

`check(spec)` compiles without a tokenizer (the server's 400 on a bad schema before the request is queued).
Plain Python: no JAX.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Iterable, Sequence

import numpy as np

from deepinfer_jax.types import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256  # compiled grammar texts kept by GrammarCompiler (a schema reused by many requests compiles once)


def mask_words(vocab_size: int) -> int:
    """int32 words in one row of the packed token bitmask."""
    return (vocab_size + 31) // 32


def _llg():
    """The llguidance module; a ValueError naming the package where it is not installed (the engine then serves
    without structured output, and each structured-output request gets this error)."""
    try:
        import llguidance
    except ModuleNotFoundError as e:
        raise ValueError("structured output needs the llguidance package (a dependency of deepinfer-jax: "
                         "pip install -e . installs it)") from e
    return llguidance


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of `spec` (not yet checked). ValueError names the field for a spec that is not
    even well-formed (a JSON schema that is not JSON)."""
    llg, kind = _llg(), spec.kind
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "json":
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {schema!r}")
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.json: {e}") from None
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    try:
        return llg.grammar_from("grammar", spec.grammar)
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar: {e}") from None


def _first_line(msg: str) -> str:
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return "; ".join(lines[:4]) if lines else "rejected"


def check(spec: StructuredOutputsParams) -> None:
    """Compile `spec` without a tokenizer; ValueError("structured_outputs.<field>: <what>") if it does not."""
    err = _llg().LLMatcher.validate_grammar(grammar_text(spec))
    if err:
        raise ValueError(f"structured_outputs.{spec.kind}: the grammar compiler rejected it: {_first_line(err)}")


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
    """An llguidance LLTokenizer for our text.Tokenizer, from its tokenizer.json (the tokenizers backend).
    A sentencepiece tokenizer is refused: llguidance re-tokenizes forced text through it, and sentencepiece's
    dummy-prefix space then makes the masks allow tokens the grammar rejects."""
    backend = getattr(tokenizer, "_backend", None)
    rust = getattr(backend, "tok", None)
    if rust is None or not hasattr(rust, "to_str"):
        raise ValueError("structured_outputs needs a tokenizer.json (Hugging Face tokenizers) tokenizer; this "
                         f"model's is {getattr(tokenizer, 'backend_kind', type(tokenizer).__name__)}")
    known = rust.get_vocab_size(with_added_tokens=True)
    eos = [int(t) for t in eos_token_ids if int(t) < known]  # an id past the tokenizer's table has no text
    if not eos:
        raise ValueError(f"structured_outputs needs an EOS token the tokenizer knows; the model's EOS ids "
                         f"{list(eos_token_ids)} are all past its {known} tokens")
    return _llg().LLTokenizer(rust.to_str(), n_vocab=vocab_size, eos_token=eos)


def _json_rule(schema: Any) -> str:
    """A Lark `%json` rule body for `schema`, in JSON_OPTIONS' layout."""
    if not isinstance(schema, dict):
        schema = {"type": "object"}
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}})


def tool_call_grammar(tools: Sequence[dict], parser: str, token_id, named: str | None = None,
                      parallel: bool = True) -> str:
    """A Lark grammar for the rest of a forced tool-call block, after the prefix the chat handler puts at the start
    of the assistant turn (server/serving_chat.py `forced_tool_prefix`: the block and first call markers, for
    deepseek_v3 "function" and the separator, and for a named function the whole call head): the call(s) in the
    tool parser's format, each function's arguments valid under its `parameters` schema, then the block's end.
    `token_id(marker)`: a marker's special-token id. `named`: only that function, one call; else any of `tools`,
    one call or (with `parallel`) several."""
    from deepinfer_jax.text.tool_parsers import CALL_BEGIN, CALL_END, CALLS_END, TOOL_SEP

    if parser not in ("deepseek_v3", "deepseek_v31"):
        raise ValueError(f"no tool-call grammar for the parser {parser!r}")
    ids = {}
    for m in (CALL_BEGIN, CALL_END, CALLS_END, TOOL_SEP):
        i = token_id(m)
        if i is None:
            raise ValueError(f"the tokenizer has no token {m!r}, which forced tool calls need")
        ids[m] = f"<[{int(i)}]>"
    fns = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
    v3 = parser == "deepseek_v3"
    rules = []
    for k, (name, schema) in enumerate(fns.items()):
        rules.append(f"args{k}: {_json_rule(schema)}")
    nl = json.dumps("\n")  # the Lark literal of a newline
    if named is not None:
        k = list(fns).index(named)
        end = json.dumps("\n```") + " " if v3 else ""
        return "\n".join([f"start: args{k} {end}{ids[CALL_END]} {ids[CALLS_END]}", *rules])
    heads = []
    for k, name in enumerate(fns):
        if v3:
            heads.append(f"{json.dumps(name + chr(10) + '```json' + chr(10))} args{k} {json.dumps(chr(10) + '```')}")
        else:
            heads.append(f"{json.dumps(name)} {ids[TOOL_SEP]} args{k}")
    # The prefix ends inside the first call: after its begin marker (and for deepseek_v3 "function" and the
    # separator); later calls (parallel) are whole.
    head = f'"function" {ids[TOOL_SEP]} ' if v3 else ""
    more = (f"({nl} {ids[CALL_BEGIN]} call)*" if v3 else f"({ids[CALL_BEGIN]} call)*") if parallel else ""
    return "\n".join([f"start: call_rest {ids[CALL_END]} {more} {ids[CALLS_END]}",
                      f"call: {head}call_rest {ids[CALL_END]}", "call_rest: " + " | ".join(heads), *rules])


class GrammarMatcher:
    """One sequence's matcher (an llguidance LLMatcher): advanced on each accepted token. With `after_token_id`
    (StructuredOutputsParams) it waits, every token allowed, until that token has been accepted."""

    def __init__(self, matcher: Any, compiler: "GrammarCompiler", after_token_id: int | None = None):
        self._m, self._compiler = matcher, compiler
        self.num_accepted = 0  # tokens the grammar consumed
        self._gate = after_token_id
        self.waiting = after_token_id is not None  # the grammar has not started yet (its gate token is to come)
        self._free = 0  # tokens accepted before the grammar started, the gate token included

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False (and the matcher stays in error) if the grammar forbids it."""
        if self.waiting:
            self._free += 1
            self.waiting = int(token_id) != self._gate
            return True
        ok = self._m.consume_token(int(token_id))
        self.num_accepted += ok
        return bool(ok)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (over the gate too: the grammar then waits again)."""
        mine = min(num_tokens, self.num_accepted)
        if mine > 0:
            self._m.rollback(mine)
            self.num_accepted -= mine
        free = num_tokens - mine
        if free > 0:
            self.waiting = True  # back before the gate token
            self._free -= free

    def is_terminated(self) -> bool:
        """The grammar takes nothing more but EOS (or the matcher is in error)."""
        return not self.waiting and self._m.is_stopped()

    def is_accepting(self) -> bool:
        return not self.waiting and self._m.is_accepting()

    @property
    def error(self) -> str:
        return self._m.get_error()

    def allowed_ids(self) -> np.ndarray:
        """The token ids allowed next (tests and debugging; the engine uses `fill_bitmasks`)."""
        bits = np.full((1, mask_words(self._compiler.vocab_size)), -1, np.int32)
        GrammarMatcher.fill_bitmasks([(self, 0)], bits)
        return allowed_ids(bits[0], self._compiler.vocab_size)

    @staticmethod
    def fill_bitmasks(rows: Iterable[tuple["GrammarMatcher", int]], bits: np.ndarray) -> None:
        """Write each (matcher, row)'s allowed next tokens into row `row` of `bits` (int32 [R, W], C-contiguous),
        the matchers in parallel on the compiler's thread pool. A matcher in error allows only EOS, so its
        request ends."""
        rows = list(rows)
        if not rows:
            return
        if bits.dtype != np.int32 or bits.ndim != 2 or not bits.flags["C_CONTIGUOUS"]:
            raise ValueError("bits must be a C-contiguous int32 [rows, words] array")
        compiler = rows[0][0]._compiler
        if bits.shape[1] != mask_words(compiler.vocab_size):
            raise ValueError(f"bits rows have {bits.shape[1]} words, the vocabulary needs "
                             f"{mask_words(compiler.vocab_size)}")
        ok = [(g._m, r) for g, r in rows if not g._m.is_error() and not g.waiting]
        for g, r in rows:
            if g.waiting:
                bits[r] = -1
            elif g._m.is_error():
                bits[r] = 0
                for t in compiler.eos_token_ids:
                    bit = 1 << (t % 32)
                    bits[r, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit
        if ok:
            compiler.executor.unsafe_compute_mask_ptr(ok, bits.ctypes.data, bits.shape[1] * 4, bits.shape[0])


def allowed_ids(bits_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids whose bit is set in one packed row (int32 [W])."""
    flat = np.unpackbits(np.ascontiguousarray(bits_row).view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(flat)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary (the model's: its logits' width).

    The LLTokenizer (a pass over the vocabulary) is built on first use; compiled grammar texts are cached."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], num_threads: int | None = None):
        if not eos_token_ids:
            raise ValueError("structured output needs the model's EOS token id")
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._num_threads = num_threads
        self._ll_tok = self._executor = None
        self._texts: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        if self._ll_tok is None:
            self._ll_tok = _ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._ll_tok

    @property
    def executor(self):
        if self._executor is None:
            self._executor = _llg().LLExecutor(self._num_threads)
        return self._executor

    def _text(self, spec: StructuredOutputsParams) -> str:
        key = repr((spec.kind, json.dumps(getattr(spec, spec.kind), sort_keys=True)))
        with self._lock:
            if key in self._texts:
                self._texts.move_to_end(key)
                return self._texts[key]
        text = grammar_text(spec)
        with self._lock:
            self._texts[key] = text
            while len(self._texts) > _CACHE_SIZE:
                self._texts.popitem(last=False)
        return text

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; ValueError naming the field if the compiler rejects it."""
        m = _llg().LLMatcher(self.ll_tokenizer, self._text(spec), log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs.{spec.kind}: the grammar compiler rejected it: "
                             f"{_first_line(m.get_error())}")
        return GrammarMatcher(m, self, spec.after_token_id)
