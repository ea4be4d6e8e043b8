"""`Tokenizer`: one object for ids <-> text, special tokens and chat templates.

Loading (`load_tokenizer(model_dir, chat_template=None)`):
- `tokenizer.json` is loaded with `tokenizers`; otherwise `tokenizer.model` with
  `sentencepiece`; otherwise `TokenizerNotFoundError` (a FileNotFoundError) names the directory
  and the files looked for.
- `tokenizer_config.json` (optional): `added_tokens_decoder` (registered as added tokens at their
  declared ids, matched whole in text; its `special` flags win), `bos_token` / `eos_token` / `pad_token` / `unk_token` (a string or a dict with
  "content"), `add_bos_token` / `add_eos_token`, `chat_template`. `special_tokens_map.json` is a
  fallback for the token strings.
- `config.json` / `generation_config.json` (optional): `bos_token_id`, `eos_token_id` (an int or
  a list), `model_type` and `_name_or_path` (template choice, see chat_template.py).

Ids: `bos_token_id` is the id of the `bos_token` string, else config.json's, else the
sentencepiece model's. Likewise `eos_token_id`. `eos_token_ids` is, in order and without
repeats: eos_token_id, config.json eos ids, generation_config.json eos ids, and `<|EOT|>` when
the vocabulary has it.

BOS exactly once: `encode(text, add_special_tokens=True)` adds BOS (when the model wants one:
`add_bos_token`, default true for sentencepiece; for tokenizer.json without that key the
file's own post-processor decides) but never when the text already starts with the BOS token,
so encoding a rendered chat template never yields two. `apply_chat_template(tokenize=True)`
encodes with add_special_tokens=False, as transformers does.

Skipping: `decode(ids, skip_special_tokens=True)` drops ids marked special (tokenizer.json /
added_tokens_decoder `special: true`, and the bos/eos/pad/unk ids) except those whose strings
are listed in `keep_special_tokens` (e.g. a parser's `<think>` or tool-call markers).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Sequence

from ._backends import HFBackend, SPBackend
from .chat_template import ChatTemplateError, render_chat_template, resolve_chat_template

EOT_TOKEN = "<|EOT|>"


class TokenizerNotFoundError(FileNotFoundError):
    """The model directory has neither tokenizer.json nor tokenizer.model."""


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_str(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """Text <-> ids for one model. Build it with `load_tokenizer`."""

    def __init__(self, backend: HFBackend | SPBackend, *, tokenizer_config: Mapping[str, Any],
                 config: Mapping[str, Any], generation_config: Mapping[str, Any],
                 special_tokens_map: Mapping[str, Any], model_dir: str | None = None,
                 chat_template: str | None = None):
        self._backend = backend
        self.model_dir = model_dir
        self.backend_kind = backend.kind
        tc, cfg, gen = tokenizer_config, config, generation_config

        def tok(name: str) -> str | None:
            return _token_str(tc.get(name)) or _token_str(special_tokens_map.get(name))

        bos_cfg = _id_list(cfg.get("bos_token_id")) or _id_list(gen.get("bos_token_id"))
        eos_cfg, eos_gen = _id_list(cfg.get("eos_token_id")), _id_list(gen.get("eos_token_id"))
        self.bos_token_id = self._resolve_id(tok("bos_token"), bos_cfg, backend.bos_id())
        self.eos_token_id = self._resolve_id(tok("eos_token"), eos_cfg + eos_gen, backend.eos_id())
        self.bos_token = tok("bos_token") or self._maybe_token(self.bos_token_id)
        self.eos_token = tok("eos_token") or self._maybe_token(self.eos_token_id)
        self.pad_token, self.unk_token = tok("pad_token"), tok("unk_token")
        self.pad_token_id = self.convert_tokens_to_ids(self.pad_token) if self.pad_token else None
        eos_ids: list[int] = []
        eot = backend.token_to_id(EOT_TOKEN)
        for i in ([self.eos_token_id] if self.eos_token_id is not None else []) + eos_cfg + eos_gen + (
                [eot] if eot is not None else []):
            if i not in eos_ids:
                eos_ids.append(i)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)

        self._add_bos = tc.get("add_bos_token")
        if self._add_bos is None and backend.kind == "sentencepiece":
            self._add_bos = True
        self._add_eos = bool(tc.get("add_eos_token", False))

        flags = {i: s for i, (_, s) in backend.added_tokens().items()}
        for key, entry in (tc.get("added_tokens_decoder") or {}).items():
            if isinstance(entry, Mapping) and str(key).isdigit() and "special" in entry:
                if backend.token_to_id(_token_str(entry) or "") == int(key):
                    flags[int(key)] = bool(entry["special"])
        special = {i for i, s in flags.items() if s}
        for t in (self.bos_token, self.eos_token, self.pad_token, self.unk_token):
            i = self.convert_tokens_to_ids(t) if t else None
            if i is not None:
                special.add(i)
        self.all_special_ids: frozenset[int] = frozenset(special)

        self.chat_templates, self.chat_template_source = resolve_chat_template(
            model_dir, tc, cfg, chat_template,
            has_user_token=backend.token_to_id("<｜User｜>") is not None)

    # -- ids ---------------------------------------------------------------------------------
    def _resolve_id(self, token: str | None, fallback_ids: list[int], backend_id: int | None):
        if token is not None:
            i = self._backend.token_to_id(token)
            if i is not None:
                return i
        if fallback_ids:
            return fallback_ids[0]
        return backend_id

    def _maybe_token(self, i: int | None) -> str | None:
        return None if i is None else self._backend.id_to_token(i)

    @property
    def vocab_size(self) -> int:
        """Largest token id + 1 (the model's embedding may be padded larger)."""
        return self._backend.vocab_size

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]):
        """A token string -> id (None when unknown); a list -> list of the same."""
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(t) for t in tokens]

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # -- encode / decode ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids. With add_special_tokens, BOS is added at most once (module docstring)."""
        bos = self.bos_token_id
        if not add_special_tokens:
            return self._backend.encode(text, add_special_tokens=False)
        if self._add_bos is None:  # tokenizer.json's own post-processor decides
            ids = self._backend.encode(text, add_special_tokens=True)
            if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
                ids = ids[1:]
            return ids
        ids = self._backend.encode(text, add_special_tokens=False)
        if self._add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        if self._add_eos and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    def skipped_ids(self, keep_special_tokens: Iterable[str] = ()) -> frozenset[int]:
        """The ids `decode(skip_special_tokens=True, keep_special_tokens=...)` drops."""
        keep = {self._backend.token_to_id(t) for t in keep_special_tokens}
        if not keep:  # the common case, once a request: no copy of a set that can hold a vocabulary's worth of ids
            return self.all_special_ids
        return frozenset(i for i in self.all_special_ids if i not in keep)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
               keep_special_tokens: Iterable[str] = ()) -> str:
        """Ids -> text (ints or NumPy integers). Ids outside the vocabulary decode to nothing."""
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            skip = self.skipped_ids(keep_special_tokens)
            ids = [i for i in ids if i not in skip]
        return self._backend.decode(ids)

    def decode_filtered(self, ids: Sequence[int]) -> str:
        """Decode ids that were already filtered (the detokenizer's fast path)."""
        return self._backend.decode(ids)

    # -- chat --------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs: Any) -> str | list[int]:
        """Render the conversation; with tokenize=True return ids (no BOS beyond the template's).

        Extra keywords (e.g. thinking=True) reach the template as variables.
        Raises ChatTemplateError (a ValueError) on template errors or when there is no template.
        """
        template = self.chat_templates.get("tool_use") if tools else None
        template = template or self.chat_template
        if template is None:
            raise ChatTemplateError(
                f"no chat template for {self.model_dir!r}: the directory has none and no built-in "
                "template fits; pass one (--chat-template PATH_OR_STRING or a built-in name)")
        text = render_chat_template(
            template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
            special_tokens={"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                            "pad_token": self.pad_token or "", "unk_token": self.unk_token or ""},
            **kwargs)
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def __repr__(self) -> str:
        return (f"Tokenizer({self.backend_kind}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token_id}, eos={self.eos_token_ids}, "
                f"template={self.chat_template_source})")


def load_tokenizer(model_dir: str, chat_template: str | None = None) -> Tokenizer:
    """Load the tokenizer of an HF model directory (see module docstring).

    `chat_template`: the server's --chat-template (a file path, a built-in name or template text);
    it wins over the directory's template.
    """
    if not os.path.isdir(model_dir):
        raise TokenizerNotFoundError(f"model directory {model_dir!r} does not exist")
    tc = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    tj, tm = os.path.join(model_dir, "tokenizer.json"), os.path.join(model_dir, "tokenizer.model")
    backend: HFBackend | SPBackend
    if os.path.isfile(tj) or os.path.isfile(tm):
        path = tj if os.path.isfile(tj) else tm
        try:
            backend = HFBackend(tj) if path == tj else SPBackend(tm)
        except Exception as e:  # the Rust / C++ libraries raise bare Exception / RuntimeError
            raise ValueError(f"{path} cannot be read as a tokenizer ({e})") from None
    else:
        raise TokenizerNotFoundError(
            f"no tokenizer in {model_dir!r}: expected tokenizer.json (HF tokenizers) or "
            "tokenizer.model (sentencepiece)")
    _add_config_tokens(backend, tc.get("added_tokens_decoder") or {})
    return Tokenizer(
        backend, tokenizer_config=tc,
        config=_read_json(os.path.join(model_dir, "config.json")),
        generation_config=_read_json(os.path.join(model_dir, "generation_config.json")),
        special_tokens_map=_read_json(os.path.join(model_dir, "special_tokens_map.json")),
        model_dir=model_dir, chat_template=chat_template)


def _add_config_tokens(backend: HFBackend | SPBackend, decoder: Mapping[str, Any]) -> None:
    """Register tokenizer_config.json `added_tokens_decoder` entries as added tokens (matched
    whole in text, as transformers does), keeping their declared ids."""
    wanted: dict[int, tuple[str, bool]] = {}
    for key, entry in decoder.items():
        content = _token_str(entry)
        if content is None or not str(key).isdigit():
            continue
        wanted[int(key)] = (content, bool(entry.get("special", False)) if isinstance(entry, Mapping) else False)
    if isinstance(backend, SPBackend):
        backend.add_tokens_with_ids(wanted)
        return
    have = {c for c, _ in backend.added_tokens().values()}
    missing = [(i, t) for i, t in sorted(wanted.items()) if t[0] not in have]
    if missing:
        backend.add_tokens([t for _, t in missing])
        wrong = [(t[0], i, backend.token_to_id(t[0])) for i, t in missing if backend.token_to_id(t[0]) != i]
        if wrong:
            raise ValueError(
                "tokenizer_config.json added_tokens_decoder ids do not follow tokenizer.json's "
                f"vocabulary: (token, declared id, assigned id) = {wrong[:5]}")
