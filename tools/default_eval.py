"""Evaluation and model card of the default model (used by tools/train_default_model.py and by tests).

`judge(skill, check, text)` decides one reply; `evaluate(model_dir, n)` runs n held-out prompts per skill
(single-turn, plus "multi": conversations with earlier exchanges whose last turn is judged by its skill)
through our LLM engine (greedy) and returns the rates; `write_card` writes the model card with the rates
between EVAL markers, which `read_rates` reads back (tests hold them as lower bounds).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

import default_model_data as data

THINK_START, THINK_END, EOS = "<think>", "</think>", "<｜end▁of▁sentence｜>"
SKILLS = ("chat", "arith", "tool", "tool_answer", "json", "multi")
MULTI_EARLIER = (1, 2, 3)  # earlier exchanges of a "multi" conversation, equally often
CRITERIA = {
    "chat": "every sentence of the reply is one of the model's known reply sentences (greetings, what it is, "
            "small talk; a held-out name filled in where the reply greets by name)",
    "arith": "reasoning (text in <think>...</think>) is present and the last number of the answer is right",
    "tool": "the deepseek_v3 tool parser finds exactly one call, of the right function, with the right arguments",
    "tool_answer": "after the tool result message the reply is the expected sentence built from the result",
    "json": "the reply parses as a JSON object whose keys are exactly the asked ones",
    "multi": "1-3 earlier exchanges of any skills (their reference replies in the history, an arithmetic one "
             "without its reasoning, as clients send it back) before a last turn of any skill; the reply to it "
             "meets that skill's criterion",
}
_MARK = re.compile(r"<!-- EVAL-RATES (\{.*?\}) -->")


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, content) of a raw reply that may open with <think>."""
    t = text.replace(EOS, "")
    if t.lstrip().startswith(THINK_START) and THINK_END in t:
        r, c = t.lstrip()[len(THINK_START):].split(THINK_END, 1)
        return r.strip(), c.strip()
    return "", t.strip()


def judge(kind: str, want, reasoning: str, content: str, tool_calls: list[tuple[str, str]]) -> bool:
    """One reply against its check (`data.example`'s third item): kind and expected value."""
    if kind == "chat":
        return not tool_calls and data.chat_ok(content, want)
    if kind == "arith":
        nums = re.findall(r"-?\d+", content)
        return bool(reasoning) and bool(nums) and int(nums[-1]) == want
    if kind == "tool":
        if len(tool_calls) != 1 or tool_calls[0][0] != want[0]:
            return False
        try:
            return json.loads(tool_calls[0][1]) == want[1]
        except ValueError:
            return False
    if kind == "tool_answer":
        return not tool_calls and content.strip() == want
    if kind == "json":
        try:
            obj = json.loads(content)
        except ValueError:
            return False
        return isinstance(obj, dict) and sorted(obj) == sorted(want)
    raise ValueError(f"unknown check {kind!r}")


def eval_set(n: int, seed: int = 1) -> list[tuple[str, list, list | None, tuple]]:
    """n held-out prompts per skill: (skill, messages without the reply, tools, check). The single-turn
    skills have no earlier exchange; "multi" has 1-3 (`MULTI_EARLIER`) and a last turn of the training mix
    of skills (after earlier exchanges: thanks or goodbye in half of the small talk, follow-up questions)."""
    rng, out = np.random.default_rng(seed), []
    for skill in data.SKILLS:
        got: dict[str, int] = {}
        kinds = (skill,) if skill != "tool" else ("tool", "tool_answer")  # not the tool skill's no-tool replies
        while min(got.get(k, 0) for k in kinds) < n:
            msgs, tools, check = data.example(rng, "eval", skill, earlier=0)
            if check[0] in kinds and got.get(check[0], 0) < n:
                got[check[0]] = got.get(check[0], 0) + 1
                out.append((check[0], msgs[:-1], tools, check))
    for i in range(n):  # earlier replies as clients send them back: no reasoning, no NO_LOSS key
        msgs, tools, check = data.example(rng, "eval", earlier=MULTI_EARLIER[i % len(MULTI_EARLIER)],
                                          keep_reasoning=0.0)
        msgs = [{k: v for k, v in m.items() if k != data.NO_LOSS} for m in msgs[:-1]]
        out.append(("multi", msgs, tools, check))
    return out


def evaluate(model_dir: str, n: int, seed: int = 1, llm=None) -> dict:
    """Rates per skill on n held-out prompts each, through our LLM engine, greedy."""
    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.text.tool_parsers import DeepSeekV3ToolParser

    llm = llm or LLM(model_dir, dtype="float32", max_model_len=1024, max_num_seqs=64, page_size=16)
    sp = SamplingParams(temperature=0.0, max_tokens=96, skip_special_tokens=False)
    items = eval_set(n, seed)
    ok = {k: 0 for k in SKILLS}
    samples: dict[str, list] = {k: [] for k in SKILLS}
    for tools in (None, data.TOOLS):
        group = [it for it in items if (it[2] is None) == (tools is None)]
        if not group:
            continue
        outs = llm.chat([it[1] for it in group], sp, tools=tools)
        for (kind, msgs, _, check), o in zip(group, outs):
            text = o.outputs[0].text
            content, calls = DeepSeekV3ToolParser().extract(text.replace(EOS, ""))
            reasoning, content = split_reasoning(content)
            good = judge(check[0], check[1], reasoning, content, [(c.name, c.arguments) for c in calls])
            ok[kind] += good
            if len(samples[kind]) < 3 or (kind == "multi" and not good and len(samples[kind]) < 8):
                samples[kind].append((msgs[-1]["content"], text.replace(EOS, ""), good))
    rates = {k: round(ok[k] / n, 3) for k in SKILLS}
    for k in SKILLS:
        print(f"{k:12s} {rates[k]:.3f}   e.g. {samples[k][0][0]!r} -> {samples[k][0][1][:120]!r}")
        for msg, text, good in samples[k] if k == "multi" else ():
            print(f"{'':12s} {'ok ' if good else 'BAD'}   {msg!r} -> {text[:100]!r}")
    return {"n": n, "rates": rates, "samples": samples}


def read_eval(card: str) -> dict:
    """{"n": prompts per skill, "rates": {skill: rate}} as written by `write_card` ({} when the card has none)."""
    if not os.path.exists(card):
        return {}
    m = _MARK.search(open(card, encoding="utf-8").read())
    return json.loads(m.group(1)) if m else {}


def read_rates(card: str) -> dict[str, float]:
    """The rates written by `write_card` ({} when the card has none)."""
    return read_eval(card).get("rates", {})


def _base_lines(base: dict | None) -> list[str]:
    """The card's lines for the training a fine-tune (train_default_model.py --init) started from, oldest first."""
    if not base:
        return []
    return [*_base_lines(base.get("base")),
            f"- from {base['steps']} steps of {base['tokens_per_step']} tokens ({base['conversations']} "
            f"conversations, seed {base['seed']}, {base['train_seconds']} s on {base['device']}), then fine-tuned:"]


def write_card(card: str, model_dir: str, result: dict) -> None:
    log_path = os.path.join(model_dir, "train_log.json")
    log = json.load(open(log_path)) if os.path.exists(log_path) else None
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    lines = ["# deepinfer default model", "",
             "The model `deepinfer serve` and `deepinfer chat` use when no `--model` is given: a "
             f"DeepSeek-V3-architecture model ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
             f"{cfg['n_routed_experts']} routed experts top-{cfg['num_experts_per_tok']} plus a shared one, MLA, "
             f"noaux_tc router, {cfg.get('num_nextn_predict_layers', 0)} MTP layer(s), vocabulary "
             f"{cfg['vocab_size']}), small enough to ship in the package.", ""]
    if log:
        lines += ["## Training", "",
                  "`tools/train_default_model.py` generated the conversations from templates and word lists "
                  "(tools/default_model_data.py: greetings and small talk, two-digit sums worked in columns and "
                  "one-digit products in a <think> working, get_weather / get_time tool calls and answers from tool "
                  "results, JSON with asked keys, after 0-3 earlier exchanges of any skills; cities, timezones "
                  "and names mostly made up by a syllable generator so that they are copied, not recalled), "
                  "rendered them through the built-in deepseek_v3 chat "
                  "template, trained the BPE tokenizer on them (one token per digit; a name tokenizes alike in prose "
                  "and JSON) and the model with the loss on assistant tokens (main + 0.3 x MTP).", "",
                  *_base_lines(log.get("base")),
                  f"- {log['steps']} steps of {log['tokens_per_step']} tokens, seed {log['seed']}, "
                  f"{log['conversations']} conversations, {log['params'] / 1e6:.2f}M parameters",
                  f"- {log['train_seconds']} s of training ({log['total_seconds']} s in all) on {log['device']}",
                  f"- final loss {log['curve'][-1]['main']:.4f} (MTP {log['curve'][-1]['mtp']:.4f}); "
                  "curve in train_log.json and loss.svg of the training output", ""]
    lines += ["## Evaluation", "",
              f"{result['n']} held-out prompts per skill (cities, names, timezones, number pairs, JSON key sets "
              "and user sentences never seen in training; one-digit products are trained facts, asked in new "
              "sentences; single-turn but for multi, whose last turn counts, after earlier exchanges given "
              "with their reference replies), greedy, through deepinfer's own engine "
              "(`python tools/train_default_model.py --eval-only DIR`):", "",
              "| skill | rate | criterion |", "|---|---|---|"]
    lines += [f"| {k} | {result['rates'][k]:.3f} | {CRITERIA[k]} |" for k in SKILLS]
    lines += ["", "Tests (tests/e2e/test_default_model.py) hold these rates as lower bounds through the server.",
              "", f"<!-- EVAL-RATES {json.dumps({'n': result['n'], 'rates': result['rates']})} -->", ""]
    with open(card, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print(f"wrote {card}")
