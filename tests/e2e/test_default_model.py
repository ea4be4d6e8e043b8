"""The shipped default model holds the rates of its model card, through the real server and the official client.

The card (deepinfer_jax/assets/default-model/README.md, written by tools/train_default_model.py) records
each skill's rate on held-out prompts; here K fresh held-out prompts per skill go through `deepinfer serve`
(no --model, deepseek_r1 reasoning parser, deepseek_v3 tool parser; "multi" conversations carry earlier
exchanges of mixed skills and are judged on their last turn) and each skill must reach the card's
rate (its n passes and fails, by Laplace's rule) less two binomial standard deviations. Shipping a better
model only changes the card. The replies are judged from what the API returns: reasoning_content, parsed
tool_calls, content.
"""

from __future__ import annotations

import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_helpers import API_KEY, SERVER_FLAGS, ServerThread

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import default_eval  # noqa: E402
import default_model_data as data  # noqa: E402

CARD = os.path.join(ROOT, "deepinfer_jax", "assets", "default-model", "README.md")
K = 8  # prompts per skill
FLAGS = [f for f in SERVER_FLAGS if f not in ("scripted", "other-name", "--served-model-name")]
FLAGS[FLAGS.index("512")] = "1024"  # --max-model-len: the tool block is long


def lower_bound(rate: float, n: int, k: int = K) -> int:
    """Replies out of k that must pass: k times the card's rate less two binomial standard deviations, the
    rate measured on n prompts taken as (passed + 1) / (n + 2) (Laplace's rule: n passes out of n do not
    make a rate of exactly 1, which would ask every one of k fresh prompts to pass)."""
    p = (rate * n + 1) / (n + 2)
    return max(0, math.floor(k * p - 2 * math.sqrt(k * p * (1 - p)) + 1e-9))


@pytest.fixture(scope="module")
def default_server(xla_cache_dir):
    st = ServerThread(["--port", "0", *FLAGS]).start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def replies(default_server):
    """skill -> [judged ok] over K held-out prompts each, all sent at once."""
    from openai import OpenAI

    items = default_eval.eval_set(K, seed=7)
    with OpenAI(base_url=default_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300) as c:
        model = c.models.list().data[0].id

        def ask(item):
            kind, msgs, tools, check = item
            msg = c.chat.completions.create(model=model, messages=msgs, tools=tools, temperature=0,
                                            max_tokens=96).choices[0].message
            calls = [(t.function.name, t.function.arguments) for t in (msg.tool_calls or [])]
            reasoning = (getattr(msg, "reasoning_content", None) or "").strip()
            return kind, default_eval.judge(*check, reasoning, (msg.content or "").strip(), calls)

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(ask, items))
    out: dict[str, list[bool]] = {k: [] for k in default_eval.SKILLS}
    for kind, ok in results:
        out[kind].append(ok)
    return out


def test_card_has_every_rate():
    rates = default_eval.read_rates(CARD)
    assert sorted(rates) == sorted(default_eval.SKILLS), f"{CARD} must record the rate of every skill"


@pytest.mark.parametrize("skill", default_eval.SKILLS)
def test_default_model_holds_its_card_rate(replies, skill):
    card = default_eval.read_eval(CARD)
    rate = card["rates"][skill]
    need = lower_bound(rate, card["n"])
    if need == 0:  # a bound of 0 would pass whatever the model does: say so rather than pass
        pytest.skip(f"{skill}: the card's rate {rate} is too low for {K} prompts to bound from below")
    got = sum(replies[skill])
    assert len(replies[skill]) == K
    assert got >= need, f"{skill}: {got}/{K} held-out prompts passed, the model card's rate asks for >= {need}"


def test_judges_accept_the_training_replies_and_reject_others():
    """The criteria pass the reply the data generator teaches and fail a wrong one (they can fail)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for skill in data.SKILLS:
        for _ in range(20):
            msgs, _, (kind, want) = data.example(rng, "eval", skill)
            last = msgs[-1]
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in last.get("tool_calls", [])]
            reasoning, content = default_eval.split_reasoning(last["content"])
            assert default_eval.judge(kind, want, reasoning, content, calls), (skill, last)
            assert not default_eval.judge(kind, want, "", "Purple monkey dishwasher", []), (skill, last)
    assert lower_bound(1.0, 60) == K - 1 and lower_bound(0.9, 60) == 5 and lower_bound(0.533, 60) == 1
    assert lower_bound(0.0, 60) == 0
