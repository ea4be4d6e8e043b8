"""Which of explore_next.sh's off-by-default switches paid in its step runs: prints their flags, one line.

    python benchmarks/pick_switches.py OUTDIR [--min-gain-ms 0.015]

A switch is picked when its step alone (step_<label>.log, "pipelined via compiled") beats the base step by at
least --min-gain-ms; with no base log it exits 1, so a following command cannot run with a guessed set.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

SWITCHES = {"qkv": "--decode-qkv-launch", "oproj": "--decode-oproj-launch", "route": "--decode-route-launch"}
STEP = re.compile(r"pipelined via compiled: ([0-9.]+) ms/step")


def step_ms(path: str) -> float | None:
    """The step time a step_profile log reports, or None when the run printed none (timed out, failed)."""
    if not os.path.exists(path):
        return None
    found = STEP.findall(open(path, encoding="utf-8", errors="replace").read())
    return float(found[-1]) if found else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--min-gain-ms", type=float, default=0.015)
    args = ap.parse_args(argv)
    base = step_ms(os.path.join(args.outdir, "step_base.log"))
    if base is None:
        print("no base step time", file=sys.stderr)
        return 1
    picked = []
    for label, flag in SWITCHES.items():
        t = step_ms(os.path.join(args.outdir, f"step_{label}.log"))
        gain = None if t is None else base - t
        print(f"{label}: {t} ms (base {base}, gain {gain})", file=sys.stderr)
        if gain is not None and gain >= args.min_gain_ms:
            picked.append(flag)
    print(" ".join(picked))
    return 0


if __name__ == "__main__":
    sys.exit(main())
