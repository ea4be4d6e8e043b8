"""The default model's (or DIR's) MTP speculation acceptance through the engine: mean acceptance length at K = 1..3.

    python tools/mtp_acceptance.py [--model DIR] [--n N] [--ks 1,2,3] [--max-tokens M]

Held-out prompts of every skill (tools/default_eval.py, N a skill), greedy, through `LLM` with
speculative_config {"method": "deepseek_mtp", "num_speculative_tokens": K}; prints, per K, the mean acceptance
length (1 + accepted drafts / steps that verified drafts), the fraction of draft tokens accepted, the acceptance
by draft position, and whether the output equals the run without speculation token for token (it must).
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "deepinfer_jax", "assets", "default-model"))
    p.add_argument("--n", type=int, default=8, help="held-out prompts per skill")
    p.add_argument("--ks", default="1,2,3", help="num_speculative_tokens values, comma-separated")
    p.add_argument("--max-tokens", type=int, default=96)
    a = p.parse_args(argv)
    ks = [int(x) for x in a.ks.split(",")]
    if a.n < 1 or not ks or min(ks) < 1:
        p.error("--n and every --ks value must be >= 1")
    print(f"{'K':>2} {'mean acc. length':>16} {'accepted':>9} {'by position':>22} {'drafts':>7} {'same output':>11}")
    for r in measure(a.model, a.n, ks, a.max_tokens):
        print(f"{r['k']:>2} {r['mean_acceptance_length']:>16.3f} {r['accepted_fraction']:>9.3f} "
              f"{str(r['per_position']):>22} {r['drafts']:>7} {str(r['same_output']):>11}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
