"""The default model's training data (tools/default_model_data.py) and tokenizer (tools/train_default_model.py).

Held-out prompts share no value (number pair, name, city, timezone, JSON key set) and no phrasing
combination with the training ones; the sums' column working is right for every pair; the tokenizer
gives one token per digit and tokenizes a name the same in prose and in JSON, so copying it is copying
tokens.
"""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import default_model_data as data  # noqa: E402


def _values(split: str, n: int = 400) -> dict[str, set]:
    """kind -> the values that n generated conversations per skill of `split` use."""
    rng = np.random.default_rng(3)
    out: dict[str, set] = {"sum": set(), "city": set(), "timezone": set(), "name": set(), "keys": set()}
    for skill in data.SKILLS:
        for _ in range(n):
            msgs, _, (kind, want) = data.example(rng, split, skill)
            user = next(m["content"] for m in reversed(msgs) if m["role"] == "user")
            if kind == "arith" and (m := re.search(r"(\d+) \+ (\d+)\.", msgs[-1]["content"])):
                out["sum"].add((int(m.group(1)), int(m.group(2))))
            elif kind == "tool":
                out["city" if want[0] == "get_weather" else "timezone"].update(want[1].values())
            elif kind == "chat" and want:
                out["name"].add(want)
            elif kind == "json":
                out["keys"].add(tuple(sorted(want)))
            assert user
    return out


def test_held_out_values_are_never_trained():
    train, held = _values("train"), _values("eval")
    for kind in train:
        assert held[kind], f"no held-out {kind} generated"
        assert not train[kind] & held[kind], f"held-out {kind} values in training: {train[kind] & held[kind]}"
        assert all(data.held_out(x) for x in held[kind]) and not any(data.held_out(x) for x in train[kind])


def test_held_out_phrasings_are_never_trained():
    rng = np.random.default_rng(0)
    for cores in (data.SUM_Q, data.WEATHER_Q, data.CHAT["thanks"][0]):
        train = {data.phrasing(rng, "train", cores) for _ in range(3000)}
        held = {data.phrasing(rng, "eval", cores) for _ in range(300)}
        assert held and not train & held, train & held


def test_made_up_names_are_many_and_pronounceable():
    rng = np.random.default_rng(0)
    names = [data.made_up_name(rng) for _ in range(2000)]
    assert len(set(names)) > 1900
    assert all(re.fullmatch(r"[A-Z][a-z]{2,14}", n) for n in names), names[:20]


def test_sum_working_is_the_column_method_and_right():
    for a in range(10, 100):
        for b in range(10, 100):
            w = data.sum_working(a, b)
            ones = re.search(r"Ones: (\d) \+ (\d) = (\d+), write (\d)", w)
            tens = re.search(r"Tens: (\d) \+ (\d)( \+ 1)? = (\d+)\.", w)
            assert (int(ones[1]), int(ones[2])) == (a % 10, b % 10) and int(ones[4]) == (a + b) % 10
            assert (int(tens[1]), int(tens[2])) == (a // 10, b // 10) and bool(tens[3]) == (a % 10 + b % 10 > 9)
            assert tens[4] + ones[4] == str(a + b) and w.endswith(f"So {a} + {b} = {a + b}.")


@pytest.fixture(scope="module")
def tokenizer():
    from deepinfer_jax.text import BUILTIN_TEMPLATES
    from train_default_model import train_tokenizer

    rng = np.random.default_rng(0)
    texts = [data.render_with_mask(*data.example(rng)[:2], BUILTIN_TEMPLATES["deepseek_v3"])[0] for _ in range(300)]
    return train_tokenizer(texts, 1024)


def test_tokenizer_splits_digits(tokenizer):
    toks = tokenizer.encode("What is 37 + 480?", add_special_tokens=False).tokens
    digits = [t for t in toks if any(c.isdigit() for c in t)]
    assert digits == ["3", "7", "4", "8", "0"], toks


def test_tokenizer_names_alike_in_prose_and_json(tokenizer):
    rng = np.random.default_rng(5)
    for _ in range(20):
        name = data.made_up_name(rng)
        prose = tokenizer.encode(f"What is the weather in {name} today?", add_special_tokens=False).ids
        js = tokenizer.encode(json.dumps({"city": name, "temperature": 3}), add_special_tokens=False).ids
        alone = tokenizer.encode(name, add_special_tokens=False).ids
        assert any(prose[i:i + len(alone)] == alone for i in range(len(prose))), name
        assert any(js[i:i + len(alone)] == alone for i in range(len(js))), name
    assert tokenizer.decode(tokenizer.encode("It is 7 degrees in Brantovel.").ids) == "It is 7 degrees in Brantovel."
