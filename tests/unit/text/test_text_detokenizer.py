"""Streaming detokenization equals one-shot decoding, for random id sequences."""

from __future__ import annotations

import io
import json
import random

import pytest

from text_helpers import CORPUS
from deepinfer_jax.text import IncrementalDetokenizer, Tokenizer, load_tokenizer

REPLACEMENT = "\ufffd"


def stream(tok, ids, chunks, prompt_ids=None, **kw) -> tuple[str, list[str]]:
    det = IncrementalDetokenizer(tok, prompt_ids=prompt_ids, **kw)
    deltas, pos = [], 0
    for n in chunks:
        deltas.append(det.add(ids[pos:pos + n]))
        pos += n
    tail = det.flush()
    assert det.text == "".join(deltas) + tail
    return "".join(deltas) + tail, deltas


def random_chunks(rng, n):
    out = []
    while n > 0:
        k = min(n, rng.choice([1, 1, 1, 2, 3, 5]))
        out.append(k)
        n -= k
    return out


def multibyte_split_ids(tok):
    """Ids of tokens that are strict parts of multi-byte characters (byte-level tokens)."""
    return [i for i in range(tok.vocab_size)
            if REPLACEMENT in tok.decode([i]) and i not in tok.all_special_ids]


def test_multibyte_characters_are_split_across_tokens(tok_v3: Tokenizer):
    ids = tok_v3.encode("你好😀🦀", add_special_tokens=False)
    assert any(REPLACEMENT in tok_v3.decode([i]) for i in ids)  # the test below is meaningful
    text, deltas = stream(tok_v3, ids, [1] * len(ids))
    assert text == "你好😀🦀"
    assert all(not d.endswith(REPLACEMENT) for d in deltas)
    assert "" in deltas  # some steps had to hold back half a character


def test_random_sequences_stream_to_one_shot_decode(tok_v3: Tokenizer):
    rng = random.Random(1234)
    vocab = list(range(tok_v3.vocab_size))
    partial = multibyte_split_ids(tok_v3)
    assert len(partial) > 50
    texts = [tok_v3.encode(t, add_special_tokens=False) for t in CORPUS]
    for case in range(600):
        kind = case % 3
        if kind == 0:  # fully random ids, specials included
            ids = [rng.choice(vocab) for _ in range(rng.randint(0, 40))]
        elif kind == 1:  # mostly byte fragments of multi-byte characters
            ids = [rng.choice(partial if rng.random() < 0.7 else vocab) for _ in range(rng.randint(1, 40))]
        else:  # real text with special tokens sprinkled in
            ids = list(rng.choice(texts))
            for _ in range(rng.randint(0, 3)):
                ids.insert(rng.randint(0, len(ids)), rng.choice(sorted(tok_v3.all_special_ids)))
        skip = bool(case & 4)
        keep = ("<think>", "</think>") if case & 8 else ()
        expected = tok_v3.decode(ids, skip_special_tokens=skip, keep_special_tokens=keep)
        text, deltas = stream(tok_v3, ids, random_chunks(rng, len(ids)),
                              skip_special_tokens=skip, keep_special_tokens=keep)
        assert text == expected, (ids, deltas)
        assert all(not d.endswith(REPLACEMENT) for d in deltas), (ids, deltas)


def test_prompt_context(tok_v3: Tokenizer):
    rng = random.Random(7)
    for _ in range(200):
        prompt_text = rng.choice(CORPUS)[: rng.randint(0, 30)]
        prompt = tok_v3.encode(prompt_text)
        out = tok_v3.encode(rng.choice(CORPUS), add_special_tokens=False)[: rng.randint(0, 25)]
        base = tok_v3.decode(prompt, skip_special_tokens=True)
        if base.endswith(REPLACEMENT):
            continue
        whole = tok_v3.decode(prompt + out, skip_special_tokens=True)
        text, _ = stream(tok_v3, out, random_chunks(rng, len(out)), prompt_ids=prompt)
        assert text == whole[len(base):]


def test_add_accepts_single_ints_and_flush_reports_cut_characters(tok_v3: Tokenizer):
    ids = tok_v3.encode("é😀", add_special_tokens=False)
    det = IncrementalDetokenizer(tok_v3)
    out = "".join(det.add(i) for i in ids[:-1])
    assert REPLACEMENT not in out
    assert det.flush().endswith(REPLACEMENT)  # the stream really ended mid-character
    assert det.flush() == ""


try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # the seeded loops above still run
    given = None

if given is not None:
    @settings(max_examples=300, deadline=None)
    @given(data=st.data())
    def test_hypothesis_stream_equals_decode(tok_v3: Tokenizer, data):
        ids = data.draw(st.lists(st.integers(0, tok_v3.vocab_size + 3), max_size=30))
        cuts = sorted(data.draw(st.sets(st.integers(0, len(ids)), max_size=8)))
        chunks = [b - a for a, b in zip([0] + cuts, cuts + [len(ids)])]
        skip = data.draw(st.booleans())
        text, deltas = stream(tok_v3, ids, chunks, skip_special_tokens=skip)
        assert text == tok_v3.decode(ids, skip_special_tokens=skip)
        assert all(not d.endswith(REPLACEMENT) for d in deltas)
else:
    @pytest.mark.skip(reason="hypothesis is not installed")
    def test_hypothesis_stream_equals_decode():
        pass


def test_sentencepiece_streaming(tmp_path):
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 5), model_writer=buf, vocab_size=420, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, minloglevel=2)
    (tmp_path / "tokenizer.model").write_bytes(buf.getvalue())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"420": {"content": "<think>", "special": False}}}))
    tok = load_tokenizer(str(tmp_path))
    rng = random.Random(99)
    for _ in range(300):
        text = rng.choice(CORPUS + ["🦀 never seen ✨", " lead  spaces", "<think>x</think> y"])
        ids = tok.encode(text, add_special_tokens=rng.random() < 0.5)
        for _ in range(rng.randint(0, 3)):
            ids.insert(rng.randint(0, len(ids)), rng.randrange(tok.vocab_size))
        skip = rng.random() < 0.5
        got, deltas = stream(tok, ids, random_chunks(rng, len(ids)), skip_special_tokens=skip)
        assert got == tok.decode(ids, skip_special_tokens=skip), ids
        assert all(not d.endswith(REPLACEMENT) for d in deltas)


def test_numpy_ids_are_accepted(tok_v3: Tokenizer):
    np = pytest.importorskip("numpy")
    ids = np.array(tok_v3.encode("你好 world 😀", add_special_tokens=False), dtype=np.int32)
    det = IncrementalDetokenizer(tok_v3, prompt_ids=np.array([0], dtype=np.int64))
    text = det.add(ids[:3]) + det.add(np.int64(ids[3])) + det.add(ids[4:]) + det.flush()
    assert text == tok_v3.decode(ids) == "你好 world 😀"
