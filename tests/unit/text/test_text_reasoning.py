"""deepseek_r1 reasoning parser: whole text vs token-by-token and coarse token streams."""

from __future__ import annotations

import random

import pytest

from deepinfer_jax.text import (DeepSeekR1ReasoningParser, get_reasoning_parser,
                                prompt_opens_reasoning)
from text_helpers import token_deltas

KEEP = DeepSeekR1ReasoningParser.special_tokens

# (output text, starts_in_reasoning, expected reasoning, expected content)
CASES = [
    ("<think>\nPlan: add.\n</think>\n\nThe answer is 4.", False, "\nPlan: add.\n", "\n\nThe answer is 4."),
    ("<think>\nPlan: add.\n</think>\n\nThe answer is 4.", True, "\nPlan: add.\n", "\n\nThe answer is 4."),
    # prompt ended with "<think>\n": the output starts inside reasoning
    ("先想一想😀。\n</think>\n\n答案是四。", True, "先想一想😀。\n", "\n\n答案是四。"),
    # cut off before </think>: all of it is reasoning
    ("<think>still thinking about 你好", False, "still thinking about 你好", ""),
    ("still thinking <thi", True, "still thinking <thi", ""),
    # </think> without <think> (default, as vLLM)
    ("reasoning here</think>content here", True, "reasoning here", "content here"),
    # thinking known to be off: plain content, even a stray tag stays content
    ("Just an answer.", False, "", "Just an answer."),
    ("text </think> more", False, "", "text </think> more"),
    # after </think> everything is content, tags included
    ("<think>a</think>b<think>c</think>d", False, "a", "b<think>c</think>d"),
    # a <think> not at offset 0 is text
    (" <think>x</think>y", True, " <think>x", "y"),
    ("<think></think>", False, "", ""),
    ("", True, "", ""),
    ("<", False, "", "<"),
    ("<think", True, "<think", ""),
]


def streamed(parser, deltas):
    r, c = [], []
    for d in deltas:
        rd, cd = parser.feed(d)
        r.append(rd)
        c.append(cd)
    rd, cd = parser.flush()
    r.append(rd)
    c.append(cd)
    return r, c


@pytest.mark.parametrize("text,starts,reasoning,content", CASES)
def test_whole_text(text, starts, reasoning, content):
    assert DeepSeekR1ReasoningParser(starts_in_reasoning=starts).extract(text) == (reasoning, content)


@pytest.mark.parametrize("text,starts,reasoning,content", CASES)
def test_token_streams_match_whole_text(tok_v3, text, starts, reasoning, content):
    rng = random.Random(len(text))
    streams = [token_deltas(tok_v3, text, keep=KEEP)]  # token by token
    streams += [token_deltas(tok_v3, text, rng, keep=KEEP) for _ in range(5)]  # coarse
    streams += [list(text), [text]]  # character by character, and one delta
    for deltas in streams:
        r, c = streamed(DeepSeekR1ReasoningParser(starts_in_reasoning=starts), deltas)
        assert ("".join(r), "".join(c)) == (reasoning, content), deltas
        # the fields only ever grow by text that is in the final result: a partial tag that
        # later completed would have shown up here as extra characters
        assert all("</think>" not in piece for piece in r)


def test_partial_tags_are_held_until_decided():
    p = DeepSeekR1ReasoningParser(starts_in_reasoning=False)
    assert p.feed("<th") == ("", "")
    assert p.feed("ink>step one</th") == ("step one", "")
    assert p.in_reasoning and not p.reasoning_ended
    assert p.feed("ink>\n\nAns") == ("", "\n\nAns")
    assert p.reasoning_ended and not p.in_reasoning
    assert p.feed("wer</think") == ("", "wer</think")
    assert p.flush() == ("", "")


def test_begin_and_end_in_one_delta():
    p = DeepSeekR1ReasoningParser()
    assert p.feed("<think>a</think>b") == ("a", "b")


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜><think>\n")
    assert not prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜>")
    assert not prompt_opens_reasoning("<｜Assistant｜><think>\n\n</think>\n\n")


def test_registry():
    assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    assert get_reasoning_parser("qwen3") is DeepSeekR1ReasoningParser  # Qwen3's <think> follows the same rules
    assert get_reasoning_parser("deepseek_v3") is DeepSeekR1ReasoningParser  # vLLM's name for V3.1 / V3.2
    with pytest.raises(ValueError, match="valid: deepseek_r1, deepseek_v3, deepseek_v4, qwen3"):
        get_reasoning_parser("granite")


def test_random_fragment_soup_streams_consistently():
    rng = random.Random(77)
    frags = ["<think>", "</think>", "<", "</", "think", ">", "\n", "a", "你", "😀", "<th", "</thi"]
    for _ in range(3000):
        text = "".join(rng.choice(frags) for _ in range(rng.randint(0, 10)))
        starts = rng.random() < 0.5
        whole = DeepSeekR1ReasoningParser(starts_in_reasoning=starts).extract(text)
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 6)))) \
            if len(text) > 1 else []
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        r, c = streamed(DeepSeekR1ReasoningParser(starts_in_reasoning=starts), deltas)
        assert ("".join(r), "".join(c)) == whole, (text, deltas)
        # tags are dropped at most once each (the opening one and the closing one)
        assert len(whole[0]) + len(whole[1]) >= len(text) - len("<think></think>")


def test_deepseek_v3_name_follows_the_v31_prompt():
    """vLLM's `deepseek_v3` reasoning parser (V3.1 / V3.2): thinking on, the prompt ends in "<think>" and the output
    is reasoning until "</think>"; thinking off, it ends in "</think>" and the output is all content."""
    from deepinfer_jax.text import get_reasoning_parser, prompt_opens_reasoning

    cls = get_reasoning_parser("deepseek_v3")
    assert cls(prompt_opens_reasoning("<｜User｜>q<｜Assistant｜><think>")).extract("hmm</think>A") == ("hmm", "A")
    assert cls(prompt_opens_reasoning("<｜User｜>q<｜Assistant｜></think>")).extract("A</think>B") == ("", "A</think>B")


# deepseek_v4: a DSML tool-call block opened inside reasoning ends it; the `</think>` it skipped is dropped
# (vLLM's DeepSeekV4ReasoningParser: reasoning.partition(block start), content = block + rest + content).
DSML = "<｜DSML｜tool_calls>"
V4_CASES = [
    (f"plan{DSML}<｜DSML｜invoke name=\"f\">x</｜DSML｜invoke></｜DSML｜tool_calls></think>tail", True,
     "plan", f"{DSML}<｜DSML｜invoke name=\"f\">x</｜DSML｜invoke></｜DSML｜tool_calls>tail"),
    (f"<think>a</think>b{DSML}c</think>d", False, "a", f"b{DSML}c</think>d"),  # block after reasoning: verbatim
    (f"<think>a{DSML}c", False, "a", f"{DSML}c"),  # no </think> to drop
    (f"a{DSML}b</think>c</think>d", True, "a", f"{DSML}bc</think>d"),  # only the first is dropped
    ("r</think>c", True, "r", "c"),  # without a block: deepseek_r1's split
    (f"plain {DSML} text", False, "", f"plain {DSML} text"),
]


@pytest.mark.parametrize("text,starts,reasoning,content", V4_CASES)
def test_deepseek_v4_parser_whole_and_streamed(text, starts, reasoning, content):
    cls = get_reasoning_parser("deepseek_v4")
    assert cls(starts_in_reasoning=starts).extract(text) == (reasoning, content)
    rng = random.Random(len(text))
    cuts = [sorted(rng.sample(range(1, len(text)), 4)) for _ in range(8)]
    for deltas in [list(text)] + [[text[i:j] for i, j in zip([0] + c, c + [len(text)])] for c in cuts]:
        r, c = streamed(cls(starts_in_reasoning=starts), deltas)
        assert ("".join(r), "".join(c)) == (reasoning, content), deltas
