"""Tokenizer loading, special tokens, BOS-exactly-once, skipping, sentencepiece round trip."""

from __future__ import annotations

import io
import json
import os

import pytest

from text_helpers import BOS, DEEPSEEK_SPECIALS, EOS
from deepinfer_jax.text import Tokenizer, TokenizerNotFoundError, load_tokenizer

TEXTS = ["Hello world!", "你好，世界！", "Emoji 😀🎉👍 ok", "  two  spaces\nnew line", "こんにちは"]


def test_special_token_ids_follow_the_files(tok_v3: Tokenizer):
    assert tok_v3.bos_token == BOS and tok_v3.bos_token_id == DEEPSEEK_SPECIALS.index(BOS) == 0
    assert tok_v3.eos_token == EOS and tok_v3.eos_token_id == 1
    assert tok_v3.eos_token_ids == (1, DEEPSEEK_SPECIALS.index("<|EOT|>"))
    assert tok_v3.convert_tokens_to_ids("<｜User｜>") == DEEPSEEK_SPECIALS.index("<｜User｜>")
    assert tok_v3.convert_tokens_to_ids(["<think>", "</think>", "no-such-token"]) == [3, 4, None]
    assert tok_v3.id_to_token(DEEPSEEK_SPECIALS.index("<｜tool▁sep｜>")) == "<｜tool▁sep｜>"
    assert tok_v3.id_to_token(10**6) is None
    assert tok_v3.vocab_size == max(tok_v3._backend.tok.get_vocab().values()) + 1
    assert tok_v3.pad_token_id == 1
    assert set(range(len(DEEPSEEK_SPECIALS))) <= tok_v3.all_special_ids


def test_encode_decode_round_trip_and_bos_once(tok_v3: Tokenizer):
    for text in TEXTS:
        ids = tok_v3.encode(text)
        assert ids[0] == 0 and ids.count(0) == 1
        assert tok_v3.encode(text, add_special_tokens=False) == ids[1:]
        assert tok_v3.decode(ids) == BOS + text
        assert tok_v3.decode(ids, skip_special_tokens=True) == text
    # a rendered prompt already starts with BOS: never a second one
    ids = tok_v3.encode(BOS + "<｜User｜>hi<｜Assistant｜>")
    assert ids[:2] == [0, DEEPSEEK_SPECIALS.index("<｜User｜>")]
    assert tok_v3.decode(ids) == BOS + "<｜User｜>hi<｜Assistant｜>"


def test_special_tokens_are_single_ids_and_keep_list(tok_v3: Tokenizer):
    text = "<think>plan</think>answer<｜tool▁calls▁begin｜>x<｜end▁of▁sentence｜>"
    ids = tok_v3.encode(text, add_special_tokens=False)
    for t in ("<think>", "</think>", "<｜tool▁calls▁begin｜>", EOS):
        assert ids.count(tok_v3.convert_tokens_to_ids(t)) == 1
    assert tok_v3.decode(ids, skip_special_tokens=True) == "plananswerx"
    kept = tok_v3.decode(ids, skip_special_tokens=True, keep_special_tokens=("<think>", "</think>"))
    assert kept == "<think>plan</think>answerx"
    assert tok_v3.decode(ids + [10**6]) == text  # out-of-vocabulary ids decode to nothing


def test_bos_and_eos_sources(make_dir):
    # dict-valued bos in tokenizer_config (default fixture), eos list in config.json,
    # extra eos in generation_config.json
    d = make_dir("m1", config={"model_type": "deepseek_v3", "bos_token_id": 0, "eos_token_id": [1, 5]},
                 extra_files={"generation_config.json": json.dumps({"eos_token_id": [1, 7]})})
    tok = load_tokenizer(d)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.eos_token_ids == (1, 5, 7, DEEPSEEK_SPECIALS.index("<|EOT|>"))
    # no token strings at all: ids come from config.json, strings from the vocabulary
    d = make_dir("m2", tokenizer_config={"bos_token": None, "eos_token": None, "pad_token": None},
                 config={"bos_token_id": 0, "eos_token_id": 1})
    tok = load_tokenizer(d)
    assert (tok.bos_token, tok.eos_token) == (BOS, EOS)
    assert tok.encode("hi")[0] == 0


def test_add_bos_false_and_post_processor_path(make_dir, bpe_json):
    tok = load_tokenizer(make_dir("nobos", tokenizer_config={"add_bos_token": False}))
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    # No add_bos_token key: tokenizer.json's own post-processor adds BOS, still only once.
    data = json.loads(bpe_json)
    data["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {BOS: {"id": BOS, "ids": [0], "tokens": [BOS]}}}
    d = make_dir("pp", tokenizer_config={"add_bos_token": None})
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(data, f)
    tc_path = os.path.join(d, "tokenizer_config.json")
    tc = json.load(open(tc_path, encoding="utf-8"))
    del tc["add_bos_token"]
    json.dump(tc, open(tc_path, "w", encoding="utf-8"))
    tok = load_tokenizer(d)
    assert tok.encode("hi")[0] == 0 and tok.encode("hi").count(0) == 1
    assert tok.encode(BOS + "hi").count(0) == 1


def test_added_tokens_decoder_adds_missing_tokens(make_dir, bpe_json):
    n = json.loads(bpe_json)["model"]["vocab"].__len__()
    tc = {"added_tokens_decoder": {str(n): {"content": "<｜new▁marker｜>", "special": True},
                                   "3": {"content": "<think>", "special": False}}}
    tok = load_tokenizer(make_dir("added", tokenizer_config=tc))
    assert tok.convert_tokens_to_ids("<｜new▁marker｜>") == n
    assert tok.encode("a<｜new▁marker｜>b", add_special_tokens=False).count(n) == 1
    # tokenizer_config's flag wins: <think> is no longer special, so it survives skipping
    assert tok.decode(tok.encode("<think>x<｜new▁marker｜>"), skip_special_tokens=True) == "<think>x"


def test_added_token_ids_must_match_the_vocabulary(make_dir, bpe_json):
    n = len(json.loads(bpe_json)["model"]["vocab"])
    tc = {"added_tokens_decoder": {str(n + 5): {"content": "<｜gap｜>", "special": True}}}
    with pytest.raises(ValueError, match="do not follow"):
        load_tokenizer(make_dir("gap", tokenizer_config=tc))


def test_missing_tokenizer_files_raise_clearly(tmp_path):
    with pytest.raises(TokenizerNotFoundError, match="tokenizer.json.*tokenizer.model"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(TokenizerNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))
    assert issubclass(TokenizerNotFoundError, FileNotFoundError)


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    import sentencepiece as spm

    from text_helpers import CORPUS

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 5), model_writer=buf, vocab_size=420, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, minloglevel=2)
    d = tmp_path_factory.mktemp("spm") / "deepseek-llm-sp"
    d.mkdir()
    (d / "tokenizer.model").write_bytes(buf.getvalue())
    tc = {"bos_token": "<s>", "eos_token": "</s>",
          "added_tokens_decoder": {"420": {"content": "<｜User｜>", "special": True},
                                   "421": {"content": "<｜Assistant｜>", "special": True}}}
    (d / "tokenizer_config.json").write_text(json.dumps(tc, ensure_ascii=False), encoding="utf-8")
    return str(d)


def test_sentencepiece_model_loads_and_round_trips(sp_dir):
    tok = load_tokenizer(sp_dir)
    assert tok.backend_kind == "sentencepiece"
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 422)
    for text in TEXTS + ["Emoji 😀 never seen in training: 🦀"]:
        ids = tok.encode(text)
        assert ids[0] == 1 and ids.count(1) == 1
        assert tok.decode(ids, skip_special_tokens=True) == text
        # like HF's Llama tokenizers, sentencepiece's dummy-prefix space shows after "<s>"
        assert tok.decode(ids) == "<s> " + text
    ids = tok.encode("<s><｜User｜>Hello world<｜Assistant｜> Hi")
    assert ids[:2] == [1, 420] and ids.count(1) == 1 and 421 in ids
    assert tok.decode(ids) == "<s><｜User｜>Hello world<｜Assistant｜> Hi"
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world Hi"
    assert tok.convert_tokens_to_ids("<｜Assistant｜>") == 421
    assert tok.convert_tokens_to_ids("definitely-not-a-piece") is None
    # the built-in template rule: a vocabulary with <｜User｜> gets the V3 template
    assert tok.chat_template_source == "builtin:deepseek_v3"
