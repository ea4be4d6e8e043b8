"""Stop strings across chunk boundaries, with and without include_stop_str_in_output."""

from __future__ import annotations

import random

import pytest

from deepinfer_jax.text import StopChecker, StopStringMatcher, truncate_at_stop


def run(stops, chunks, include=False):
    m = StopStringMatcher(stops, include_stop_str_in_output=include)
    emitted = []
    for c in chunks:
        out = m.feed(c)
        emitted.append(out)
    emitted.append(m.flush())
    return "".join(emitted), m.matched, emitted


def all_splits(text, rng, n=30):
    yield [text]
    yield list(text)
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


CASES = [
    # (stops, text, expected without include, expected with include, matched)
    (["STOP"], "hello STOP world", "hello ", "hello STOP", "STOP"),
    (["\n\n"], "line1\nline2\n\nline3", "line1\nline2", "line1\nline2\n\n", "\n\n"),
    (["abcd", "bc"], "xxabcd", "xxa", "xxabc", "bc"),          # "bc" completes first
    (["cd", "abcd"], "xxabcdyy", "xx", "xxabcd", "abcd"),      # same end: the longer one
    (["</s>", "User:"], "a</b>c User: hi", "a</b>c ", "a</b>c User:", "User:"),
    (["停止"], "你好停止了", "你好", "你好停止", "停止"),
    (["😀!"], "a😀b😀!c", "a😀b", "a😀b😀!", "😀!"),
    (["aab"], "aaab", "a", "aaab", "aab"),                     # overlapping prefix
    (["END"], "no stop here, EN", "no stop here, EN", "no stop here, EN", None),
    ([], "anything", "anything", "anything", None),
]


@pytest.mark.parametrize("stops,text,plain,incl,matched", CASES)
def test_every_split_gives_the_whole_text_result(stops, text, plain, incl, matched):
    rng = random.Random(hash(text) & 0xFFFF)
    assert truncate_at_stop(text, stops) == (plain, matched)
    assert truncate_at_stop(text, stops, include_stop_str_in_output=True) == (incl, matched)
    for chunks in all_splits(text, rng):
        assert run(stops, chunks)[:2] == (plain, matched), chunks
        assert run(stops, chunks, include=True)[:2] == (incl, matched), chunks


def test_holds_back_possible_stop_prefix_until_decided():
    m = StopChecker(["STOP"])
    assert m.feed("abc S") == "abc "
    assert m.feed("T") == ""
    assert m.feed("Ox") == "STOx"        # not a stop after all: released
    assert m.feed("yST") == "y"
    assert m.feed("OP and more") == ""   # matched across the boundary; nothing after it
    assert (m.stopped, m.matched) == (True, "STOP")
    assert m.feed("later") == "" and m.flush() == ""


def test_include_emits_without_holding_and_cuts_after_the_stop():
    m = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert m.feed("abc ST") == "abc ST"
    assert m.feed("OP tail") == "OP"
    assert m.matched == "STOP" and m.feed("x") == ""


def test_flush_releases_held_text_without_a_match():
    m = StopStringMatcher(["<end>"])
    assert m.feed("value <en") == "value "
    assert m.flush() == "<en" and not m.stopped and m.matched is None


def test_random_texts_against_one_shot():
    rng = random.Random(5)
    alphabet = "ab\n😀"
    for _ in range(2000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        include = rng.random() < 0.5
        chunks = list(all_splits(text, rng, n=1))[-1] if text else []
        got, matched, emitted = run(stops, chunks, include)
        assert (got, matched) == truncate_at_stop(text, stops, include), (stops, text, chunks)
        if not include:  # a stop string is never partly emitted
            assert not any(s in got for s in stops)
