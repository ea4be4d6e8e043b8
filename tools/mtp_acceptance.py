"""The default model's (or DIR's) MTP speculation acceptance through the engine: mean acceptance length at K = 1..3.

    python tools/mtp_acceptance.py [--model DIR] [--n N] [--ks 1,2,3] [--max-tokens M] [--card README.md]

Held-out prompts of every skill (tools/default_eval.py, N a skill), greedy, through `LLM` with
speculative_config {"method": "deepseek_mtp", "num_speculative_tokens": K}; prints, per K, the mean acceptance
length (1 + accepted drafts / steps that verified drafts), the fraction of draft tokens accepted, the acceptance
by draft position, and whether the output equals the run without speculation token for token (it must).
`--card` writes the table into that model card (the section `SECTION`, replacing one there; after
train_default_model.py has written the card, which does not keep it, as its figures belong to the weights measured).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def measure(model_dir: str, n: int, ks: list[int], max_tokens: int) -> list[dict]:
    import default_eval
    import default_model_data as data

    from deepinfer_jax import LLM, SamplingParams

    items = default_eval.eval_set(n, seed=11)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, skip_special_tokens=False)
    args = dict(dtype="float32", max_model_len=1024, max_num_seqs=16, page_size=16, progress=False)

    def run(llm):
        out = []
        for tools in (None, data.TOOLS):
            group = [it[1] for it in items if (it[2] is None) == (tools is None)]
            if group:
                out += [o.outputs[0].token_ids for o in llm.chat(group, sp, tools=tools)]
        return out

    want = run(LLM(model_dir, **args))
    rows = []
    for k in ks:
        t = time.time()
        llm = LLM(model_dir, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": k}, **args)
        got = run(llm)
        s = llm.engine.spec_stats
        rows.append(dict(k=k, mean_acceptance_length=round(s.mean_acceptance_length, 3),
                         accepted_fraction=round(s.num_accepted_tokens / max(s.num_draft_tokens, 1), 3),
                         per_position=[round(a / max(s.num_drafts, 1), 3) for a in s.num_accepted_tokens_per_pos],
                         drafts=s.num_drafts, same_output=got == want, seconds=round(time.time() - t, 1)))
    return rows


SECTION = "## Speculative decoding with its MTP layer"


def write_section(card: str, rows: list[dict], n: int, max_tokens: int) -> None:
    """Put the MTP section (SECTION, the table of `rows`) into `card`, before its EVAL-RATES marker, replacing the
    section already there."""
    text = open(card, encoding="utf-8").read()
    start = text.find(SECTION)
    if start >= 0:  # up to the next section or the marker
        nxt = text.find("\n## ", start + 1)
        ends = [i for i in (nxt + 1 if nxt >= 0 else -1, text.find("<!-- EVAL-RATES", start)) if i >= 0]
        text = text[:start] + text[min(ends, default=len(text)):]
    lines = [SECTION, "",
             "The MTP layer trained with the model drafts for `--speculative-config '{\"method\": \"deepseek_mtp\",",
             "\"num_speculative_tokens\": K}'`. Measured with `python tools/mtp_acceptance.py --n "
             f"{n} --ks {','.join(str(r['k']) for r in rows)}` ({n} held-out prompts",
             f"a skill, greedy, up to {max_tokens} tokens each, on the CPU; the output equal to the run without "
             "speculation at every K):", "",
             "| K | mean acceptance length | draft tokens accepted | accepted by draft position |", "|---|---|---|---|"]
    lines += [f"| {r['k']} | {r['mean_acceptance_length']:.2f} | {r['accepted_fraction']:.2f} | "
              f"{', '.join(f'{a:.2f}' for a in r['per_position'])} |" for r in rows]
    at = text.find("<!-- EVAL-RATES")
    at = len(text) if at < 0 else at
    text = text[:at] + "\n".join(lines) + "\n\n" + text[at:]
    with open(card, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {SECTION!r} into {card}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "deepinfer_jax", "assets", "default-model"))
    p.add_argument("--n", type=int, default=8, help="held-out prompts per skill")
    p.add_argument("--ks", default="1,2,3", help="num_speculative_tokens values, comma-separated")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--card", default=None, help="model card to write the table into (its MTP section replaced)")
    a = p.parse_args(argv)
    ks = [int(x) for x in a.ks.split(",")]
    if a.n < 1 or not ks or min(ks) < 1:
        p.error("--n and every --ks value must be >= 1")
    print(f"{'K':>2} {'mean acc. length':>16} {'accepted':>9} {'by position':>22} {'drafts':>7} {'same output':>11}")
    rows = measure(a.model, a.n, ks, a.max_tokens)
    for r in rows:
        print(f"{r['k']:>2} {r['mean_acceptance_length']:>16.3f} {r['accepted_fraction']:>9.3f} "
              f"{str(r['per_position']):>22} {r['drafts']:>7} {str(r['same_output']):>11}", flush=True)
    if not all(r["same_output"] for r in rows):
        print("speculation changed the output: the card is not written", file=sys.stderr)
        return 1
    if a.card:
        write_section(a.card, rows, a.n, a.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
