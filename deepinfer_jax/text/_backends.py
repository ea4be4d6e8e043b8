"""Tokenizer backends: `tokenizers` (tokenizer.json) and `sentencepiece` (tokenizer.model).

Both expose the same small surface to `Tokenizer`. Invariants:
- `encode(text, add_special_tokens=False)` never adds BOS/EOS; added/special token strings
  inside `text` become their single ids.
- `decode(ids)` never skips anything (the caller filters ids first) and ignores ids outside
  the vocabulary (a model's padded vocabulary may be larger than the tokenizer's).
- `decode` is concatenative at character boundaries: if decode(a) ends in a complete
  character then decode(a + b) == decode(a) + decode(b) up to a leading-space rule of
  sentencepiece that is applied identically to both sides of the streaming window.
"""

from __future__ import annotations

import re
from typing import Iterable


class HFBackend:
    """`tokenizers.Tokenizer` loaded from tokenizer.json."""

    kind = "tokenizers"

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _RustTokenizer

        self.tok = _RustTokenizer.from_file(path)
        self._n = self._count()

    def _count(self) -> int:
        added = self.tok.get_added_tokens_decoder()
        return max([self.tok.get_vocab_size(with_added_tokens=False) - 1, *added]) + 1

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int]) -> str:
        n = self._n
        return self.tok.decode([i for i in ids if 0 <= i < n], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def added_tokens(self) -> dict[int, tuple[str, bool]]:
        return {i: (t.content, bool(t.special)) for i, t in self.tok.get_added_tokens_decoder().items()}

    def add_tokens(self, tokens: list[tuple[str, bool]]) -> None:
        from tokenizers import AddedToken

        specials = [AddedToken(c, special=True, normalized=False) for c, s in tokens if s]
        normal = [AddedToken(c, special=False, normalized=False) for c, s in tokens if not s]
        if specials:
            self.tok.add_special_tokens(specials)
        if normal:
            self.tok.add_tokens(normal)
        self._n = self._count()

    @property
    def vocab_size(self) -> int:
        return self._n

    def bos_id(self) -> int | None:
        return None

    def eos_id(self) -> int | None:
        return None


class SPBackend:
    """`sentencepiece` model plus the added tokens of tokenizer_config.json.

    Added tokens (and the model's control pieces such as <s>, </s>) are split out of the text
    before sentencepiece sees it, like HF's slow tokenizers do; they may carry ids beyond the
    sentencepiece vocabulary.
    """

    kind = "sentencepiece"

    def __init__(self, path: str):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=path)
        self.n = self.sp.get_piece_size()
        self.added: dict[int, tuple[str, bool]] = {}
        for i in range(self.n):
            if self.sp.is_control(i):
                self.added[i] = (self.sp.id_to_piece(i), True)
        self._rebuild()
        # Text after an added token must not get sentencepiece's dummy-prefix space (HF's
        # legacy=False rule): encode behind a throw-away anchor and cut the anchor off.
        self._dummy_prefix = self.sp.encode("a", out_type=str)[0].startswith("▁")
        self._anchor = self.sp.encode("<unk>")
        self._strips_first_space = not self.sp.decode(self.sp.encode("a")).startswith(" ")

    def _rebuild(self) -> None:
        self.by_content = {c: i for i, (c, _) in self.added.items()}
        alts = sorted(self.by_content, key=len, reverse=True)
        self.split_re = re.compile("(" + "|".join(map(re.escape, alts)) + ")") if alts else None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        del add_special_tokens  # BOS/EOS are added by `Tokenizer`
        if self.split_re is None:
            return list(self.sp.encode(text))
        ids: list[int] = []
        for k, part in enumerate(self.split_re.split(text)):
            if k % 2:
                ids.append(self.by_content[part])
            elif part:
                ids.extend(self._encode_segment(part, first=(k == 0)))
        return ids

    def _encode_segment(self, text: str, first: bool) -> list[int]:
        if first or not self._dummy_prefix:
            return list(self.sp.encode(text))
        ids = self.sp.encode("<unk>" + text)
        n = len(self._anchor)
        if ids[:n] == self._anchor:
            return list(ids[n:])
        return list(self.sp.encode(text))  # the anchor merged with the text; keep the prefix

    def decode(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        run: list[int] = []

        def flush_run() -> None:
            if run:
                text = self.sp.decode(run)
                # sentencepiece drops the leading "▁" of the first piece of every decode call;
                # only the start of the whole sequence should lose it.
                if out and self._strips_first_space and self.sp.id_to_piece(run[0]).startswith("▁"):
                    text = " " + text
                out.append(text)
                run.clear()

        for i in ids:
            if i in self.added:
                flush_run()
                out.append(self.added[i][0])
            elif 0 <= i < self.n:
                run.append(i)
        flush_run()
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        if token in self.by_content:
            return self.by_content[token]
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None

    def id_to_token(self, i: int) -> str | None:
        if i in self.added:
            return self.added[i][0]
        return self.sp.id_to_piece(i) if 0 <= i < self.n else None

    def added_tokens(self) -> dict[int, tuple[str, bool]]:
        return dict(self.added)

    def add_tokens_with_ids(self, tokens: dict[int, tuple[str, bool]]) -> None:
        self.added.update(tokens)
        self._rebuild()

    @property
    def vocab_size(self) -> int:
        return max([self.n - 1, *self.added]) + 1

    def bos_id(self) -> int | None:
        i = self.sp.bos_id()
        return i if i >= 0 else None

    def eos_id(self) -> int | None:
        i = self.sp.eos_id()
        return i if i >= 0 else None
