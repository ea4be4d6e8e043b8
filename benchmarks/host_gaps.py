"""What the host did while the GPU sat idle: for each idle gap of the first GPU of a perfetto trace at least
`--min-ms` long, the host events that overlap it (longest first), so that a gap caused by the host (a
program's launch, a predicate read back, Python between two dispatches) names its cause.

    python3 benchmarks/host_gaps.py TRACE_DIR [--min-ms 0.5] [--top 8]

Reads the newest trace under TRACE_DIR (`offline.py --trace DIR --trace-steps A:B` or `step_profile.py --trace`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.trace_tools import _load, first_gpu, gpu_kernels, idle_windows  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir")
    ap.add_argument("--min-ms", type=float, default=0.5)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args(argv)
    kern = first_gpu(gpu_kernels(args.trace_dir) or [])
    loaded = _load(args.trace_dir)
    if not kern or loaded is None:
        print(f"no GPU kernels in a trace under {args.trace_dir}")
        return 1
    events, gpu_pids = loaded
    host = [e for e in events if e.get("ph") == "X" and e.get("pid") not in gpu_pids]
    t0 = kern[0]["ts"]
    gaps = idle_windows(kern, args.min_ms * 1e3)
    print(f"{len(gaps)} idle gaps of at least {args.min_ms} ms, {sum(b - a for a, b, _, _ in gaps) / 1e3:.2f} ms in all:")
    for a, b, before, after in gaps:
        print(f"  at {(a - t0) / 1e3:9.2f} ms: {(b - a) / 1e3:.2f} ms idle, between {before[:40]} and {after[:40]}")
        inside = [e for e in host if e["ts"] < b and e["ts"] + e.get("dur", 0.0) > a]
        for e in sorted(inside, key=lambda e: -e.get("dur", 0.0))[: args.top]:
            print(f"      host {e.get('dur', 0.0) / 1e3:8.2f} ms from {(e['ts'] - t0) / 1e3:9.2f}  {e['name'][:90]}")
        # The program call the gap ends in (the innermost one running at its end), and what the host did
        # inside it by name: a call that outlasts its kernels' enqueue is waiting on something.
        calls = [e for e in inside if e["name"].startswith("PjitFunction") and e["ts"] + e.get("dur", 0.0) >= b]
        if calls:
            c = min(calls, key=lambda e: e.get("dur", 0.0))
            lo, hi = c["ts"], c["ts"] + c.get("dur", 0.0)
            by = defaultdict(lambda: [0, 0.0])
            for e in host:
                if lo <= e["ts"] < hi and e is not c and e.get("dur", 0.0) < c.get("dur", 0.0):
                    by[e["name"][:80]][0] += 1
                    by[e["name"][:80]][1] += e.get("dur", 0.0)
            print(f"      inside {c['name'][:40]} ({(hi - lo) / 1e3:.2f} ms, from {(lo - t0) / 1e3:.2f}), by name:")
            for name, (n, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[: args.top * 3]:
                print(f"        {us / 1e3:8.2f} ms  x{n:5d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
