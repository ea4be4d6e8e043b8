"""Where XLA's compile of a program goes, from its own pass timings: run the compile with
`TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1` (XLA then logs "HLO pass: NAME time: N us" for every
pass it runs) and give the log here.

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1 python3 benchmarks/lower_profile.py --compile \
        --pick "2048 shared forward" --limit 1 2> passes.log
    python3 benchmarks/compile_passes.py passes.log [--top 25]

Prints the passes by total time (summed over every module and pipeline that ran them), the HLO passes' total, and
each logging thread's span from its first line to its last (what is not HLO passes inside that span is the
backend: LLVM, PTX and the kernels' binaries).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from datetime import datetime

PASS = re.compile(r"HLO pass: (\S+) time: ([\d.]+) (us|ms|s) ")
US = {"us": 1, "ms": 1e3, "s": 1e6}
HEAD = re.compile(r"^[IWE](\d{4} \d\d:\d\d:\d\d\.\d+)\s+(\d+) ")


def summarize(lines) -> tuple[dict, dict, dict]:
    """Log lines -> ({pass: total us}, {pass: runs}, {thread: (first, last) datetime})."""
    total, runs, span = defaultdict(int), defaultdict(int), {}
    for line in lines:
        head = HEAD.match(line)
        if head:
            t = datetime.strptime(head.group(1), "%m%d %H:%M:%S.%f")
            first, _ = span.get(head.group(2), (t, t))
            span[head.group(2)] = (first, t)
        m = PASS.search(line)
        if m:
            total[m.group(1)] += float(m.group(2)) * US[m.group(3)]
            runs[m.group(1)] += 1
    return total, runs, span


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    with open(args.log, errors="replace") as f:
        total, runs, span = summarize(f)
    print("| HLO pass | seconds | runs |\n|---|---|---|")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| {name} | {us / 1e6:.2f} | {runs[name]} |")
    print(f"| all {len(total)} passes | {sum(total.values()) / 1e6:.2f} | {sum(runs.values())} |")
    for tid, (first, last) in sorted(span.items(), key=lambda kv: kv[1][0]):
        if (last - first).total_seconds() >= 0.5:
            print(f"thread {tid}: {first.strftime('%H:%M:%S.%f')[:-3]} to {last.strftime('%H:%M:%S.%f')[:-3]}, "
                  f"{(last - first).total_seconds():.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
