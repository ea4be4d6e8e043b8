"""The default model's (or DIR's) MTP speculation acceptance through the engine: mean acceptance length at K = 1..3.

    python tools/mtp_acceptance.py [--model DIR] [--n N] [--ks 1,2,3] [--max-tokens M] [--card README.md]

Held-out prompts of every skill (tools/default_eval.py, N a skill), greedy, through `LLM` with
speculative_config {"method": "deepseek_mtp", "num_speculative_tokens": K}; prints, per K, the mean acceptance
length (1 + accepted drafts / steps that verified drafts), the fraction of draft tokens accepted, the acceptance
by draft position, and whether the output equals the run without speculation token for token (it must).
`--timed` instead times each prompt alone (batch 1, the request's own stop, as a user's request runs) at K = 0 and
each K, in engines of `--dtype` / `--attn-impl` / `--moe-impl`: a prompt's time per output token is (its whole
request's wall time - the same request's at max_tokens 1) / (output tokens - 1), so prefill and the host's
per-request work cancel; the table gives the tokens-weighted mean beside each K's acceptance (on a GPU: the
end-to-end figure of speculation on the model's own task distribution).
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


def timed(model_dir: str, n: int, ks: list[int], max_tokens: int, engine_args: dict) -> list[dict]:
    """`--timed`: per K (0 first), each held-out prompt alone; -> rows of k, mean_acceptance_length, tpot_ms (the
    tokens-weighted mean of (wall - wall at max_tokens 1) / (tokens - 1)), tokens, same_output (against K = 0)."""
    import default_eval

    from deepinfer_jax import LLM, SamplingParams

    items = default_eval.eval_set(n, seed=11)
    full = SamplingParams(temperature=0.0, max_tokens=max_tokens, skip_special_tokens=False)
    first = SamplingParams(temperature=0.0, max_tokens=1, skip_special_tokens=False)
    rows, want = [], None
    for k in [0, *ks]:
        spec = {"speculative_config": {"method": "deepseek_mtp", "num_speculative_tokens": k}} if k else {}
        llm = LLM(model_dir, max_model_len=1024, max_num_seqs=4, page_size=16, progress=False,
                  enable_prefix_caching=False, **engine_args, **spec)  # the full run must not reuse the first's pages
        for _ in range(2):  # untimed: the first requests' host paths
            llm.chat([items[0][1]], full, tools=items[0][2])
        got, busy, steps = [], 0.0, 0
        for _, msgs, tools, _ in items:
            t = time.perf_counter()
            llm.chat([msgs], first, tools=tools)
            t1 = time.perf_counter()
            [o] = llm.chat([msgs], full, tools=tools)
            t2 = time.perf_counter()
            ids = o.outputs[0].token_ids
            got.append(list(ids))
            if len(ids) > 1:
                busy += (t2 - t1) - (t1 - t)
                steps += len(ids) - 1
        want = got if k == 0 else want
        s = llm.engine.spec_stats if k else None
        rows.append(dict(k=k, mean_acceptance_length=round(s.mean_acceptance_length, 3) if k else 1.0,
                         tpot_ms=round(1e3 * busy / max(steps, 1), 3), tokens=steps, same_output=got == want))
        del llm
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
    p.add_argument("--timed", action="store_true", help="time each prompt alone at K = 0 and each K (see above)")
    p.add_argument("--dtype", default="float32", help="--timed: the engines' dtype")
    p.add_argument("--attn-impl", default=None, help="--timed: the engines' attn_impl")
    p.add_argument("--moe-impl", default=None, help="--timed: the engines' moe_impl")
    p.add_argument("--card", default=None, help="model card to write the table into (its MTP section replaced)")
    a = p.parse_args(argv)
    ks = [int(x) for x in a.ks.split(",")]
    if a.n < 1 or not ks or min(ks) < 1:
        p.error("--n and every --ks value must be >= 1")
    if a.timed:
        engine_args = {k: v for k, v in (("dtype", a.dtype), ("attn_impl", a.attn_impl), ("moe_impl", a.moe_impl))
                       if v is not None}
        rows = timed(a.model, a.n, ks, a.max_tokens, engine_args)
        print(f"{'K':>2} {'mean acc. length':>16} {'TPOT ms':>8} {'x K=0':>6} {'tokens':>7} {'same output':>11}")
        for r in rows:
            print(f"{r['k']:>2} {r['mean_acceptance_length']:>16.3f} {r['tpot_ms']:>8.3f} "
                  f"{r['tpot_ms'] / rows[0]['tpot_ms']:>6.3f} {r['tokens']:>7} {str(r['same_output']):>11}", flush=True)
        return 0 if all(r["same_output"] for r in rows) else 1
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
