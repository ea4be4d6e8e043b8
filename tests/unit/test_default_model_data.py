"""The default model's training data (tools/default_model_data.py) and tokenizer (tools/train_default_model.py).

Held-out prompts share no value (number pair, name, city, timezone, JSON key set) and no phrasing
combination with the training ones, in the earlier exchanges of a conversation as in its last turn;
conversations hold 0-3 complete earlier exchanges of every skill, consistent with the tools offered, and
every assistant turn is in the loss mask; the sums' column working is right for every pair; the tokenizer
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


def _exchanges(msgs: list[dict]) -> list[list[dict]]:
    """The conversation (system message aside) cut into exchanges: a user message and what answers it."""
    body = msgs[1:] if msgs[0]["role"] == "system" else msgs
    assert all(m["role"] != "system" for m in body)
    out: list[list[dict]] = []
    for m in body:
        if m["role"] == "user":
            out.append([m])
        else:
            assert out, f"the conversation opens with a {m['role']} message"
            out[-1].append(m)
    return out


def _reply_kind(ex: list[dict]) -> str:
    """Which skill a complete earlier exchange shows, from its messages."""
    last = ex[-1]["content"]
    if len(ex) == 4:
        return "tool"
    if last in data.NO_TOOL.values():
        return "no_tool"
    if ex[-1].get(data.NO_LOSS):  # an arithmetic reply as a client sends it back: the answer, no working
        assert re.fullmatch(r"\d+ (\+|times) \d+ (=|is) \d+\.", last), last
        return "arith_content"
    return "arith" if last.startswith("<think>") else "json" if last.startswith("{") else "chat"


def test_conversations_have_complete_earlier_exchanges_of_every_skill():
    rng = np.random.default_rng(1)
    counts, kinds, after = [0] * 4, set(), set()
    for _ in range(1500):
        msgs, tools, check = data.example(rng)
        exs = _exchanges(msgs)
        counts[len(exs) - 1] += 1
        for ex in exs[:-1]:  # complete: user, answer; or user, call, result, answer
            roles = [m["role"] for m in ex]
            assert roles in (["user", "assistant"], ["user", "assistant", "tool", "assistant"]), roles
            assert ex[-1]["content"] and "tool_calls" not in ex[-1]
            kinds.add(_reply_kind(ex))
            assert (_reply_kind(ex) == "tool") <= (tools is not None)  # a call only where tools are offered
            assert (_reply_kind(ex) == "no_tool") <= (tools is None)  # "no tool offered" only where none is
        if check[0] in ("tool", "tool_answer"):
            assert tools is not None
        if len(exs) > 1 and check[0] == "chat":
            after.add(msgs[-1]["content"])
    assert all(c > 50 for c in counts), counts  # 0, 1, 2 and 3 earlier exchanges
    assert kinds == {"chat", "arith", "arith_content", "json", "tool", "no_tool"}, kinds
    assert {"You are welcome!", "Goodbye! Have a nice day."} <= after  # thanks and goodbye after other skills
    for k in range(4):
        assert len(_exchanges(data.example(rng, earlier=k)[0])) == k + 1


def test_follow_up_questions_only_after_earlier_exchanges():
    rng = np.random.default_rng(2)
    starts = tuple(o.strip().lower() for o in data.FOLLOW_OPENINGS)

    def last_user(msgs):
        return next(m for m in reversed(msgs) if m["role"] == "user")

    firsts = [data.example(rng, skill=s, earlier=0)[0] for s in ("arith", "json") for _ in range(300)]
    laters = [data.example(rng, skill=s, earlier=2)[0] for s in ("arith", "json") for _ in range(300)]
    assert not any(last_user(m)["content"].lower().startswith(starts) for m in firsts)
    assert sum(last_user(m)["content"].lower().startswith(starts) for m in laters) > 20  # ~45 expected


def _user_texts_and_values(split: str) -> tuple[set, set]:
    """The user messages of conversations with 3 earlier exchanges, and the sums and tool values in them."""
    rng = np.random.default_rng(4)
    texts, values = set(), set()
    for _ in range(400):
        msgs, _, _ = data.example(rng, split, earlier=3)
        for m in msgs:
            if m["role"] == "user":
                texts.add(m["content"])
            elif m["role"] == "tool":
                values.update(v for k, v in json.loads(m["content"]).items() if k in ("city", "timezone"))
            elif m["role"] == "assistant" and (s := re.search(r"(\d+) \+ (\d+)\. Ones", m["content"])):
                values.add((int(s.group(1)), int(s.group(2))))
    return texts, values


def test_earlier_exchanges_keep_the_held_out_split():
    train_texts, train_values = _user_texts_and_values("train")
    held_texts, held_values = _user_texts_and_values("eval")
    assert held_values and not any(data.held_out(v) for v in train_values)
    assert all(data.held_out(v) for v in held_values)
    assert not train_texts & held_texts, train_texts & held_texts  # phrasings, chat ones included


def test_every_assistant_turn_but_those_without_working_is_in_the_loss_mask():
    from deepinfer_jax.text import BUILTIN_TEMPLATES

    rng = np.random.default_rng(6)
    skipped = 0
    for _ in range(40):
        msgs, tools, _ = data.example(rng, earlier=3)
        skipped += sum(bool(m.get(data.NO_LOSS)) for m in msgs)
        text, spans = data.render_with_mask(msgs, tools, BUILTIN_TEMPLATES["deepseek_v3"])
        answers = [m for m in msgs if m["role"] == "assistant" and not m.get(data.NO_LOSS)]
        assert len(spans) == len(answers) >= 1 and not msgs[-1].get(data.NO_LOSS)
        for (a, b), m in zip(spans, answers):
            assert (m["content"] or m["tool_calls"][0]["function"]["arguments"]) in text[a:b]
            assert not any(t in text[a:b] for t in ("<｜User｜>", "<｜Assistant｜>", "<｜tool▁output▁begin｜>"))
        for m in msgs:  # a reply without its working is in the text, out of the loss
            if m.get(data.NO_LOSS):
                start = text.index(m["content"] + "<｜end▁of▁sentence｜>")
                assert not any(a <= start < b for a, b in spans) and "<think>" not in m["content"]
    assert skipped > 5


def test_multi_eval_set_is_held_out_multi_turn():
    import default_eval

    items = default_eval.eval_set(6, seed=3)
    multi = [it for it in items if it[0] == "multi"]
    assert len(multi) == 6 and len(items) == 6 * len(default_eval.SKILLS)
    assert sorted(len(_exchanges(m)) - 1 for _, m, _, _ in multi) == [1, 1, 2, 2, 3, 3]
    assert all(len(_exchanges(m)) == 1 for k, m, _, _ in items if k != "multi")
    assert all(m[-1]["role"] in ("user", "tool") for _, m, _, _ in items)
    replies = [x for _, m, _, _ in multi for x in m if x["role"] == "assistant"]  # as clients send them back
    assert all(set(x) <= {"role", "content", "tool_calls"} and "<think>" not in x["content"] for x in replies)


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
