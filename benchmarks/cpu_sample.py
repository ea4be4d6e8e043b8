"""Sample the machine's CPU use once a second from /proc/stat until killed (or SECONDS pass): whether a start is
bound by the CPU (every core busy) or waits on something else.

    python3 benchmarks/cpu_sample.py [SECONDS] > cpu.txt &

Each line: seconds since start, busy % of all cores (user + nice + system + irq + softirq), of which niced %,
and the runnable threads (procs_running).
"""

from __future__ import annotations

import sys
import time


def read() -> tuple[list[int], int]:
    with open("/proc/stat") as f:
        lines = f.read().splitlines()
    cpu = [int(x) for x in lines[0].split()[1:]]
    running = next(int(ln.split()[1]) for ln in lines if ln.startswith("procs_running"))
    return cpu, running


def main(argv: list[str]) -> int:
    limit = float(argv[0]) if argv else 600.0
    t0 = time.time()
    prev, _ = read()
    print("t_s busy_pct nice_pct running", flush=True)
    while time.time() - t0 < limit:
        time.sleep(1.0)
        cur, running = read()
        d = [c - p for c, p in zip(cur, prev)]
        total = sum(d[:8]) or 1  # user nice system idle iowait irq softirq steal
        busy = d[0] + d[1] + d[2] + d[5] + d[6]
        print(f"{time.time() - t0:.0f} {100 * busy / total:.0f} {100 * d[1] / total:.0f} {running}", flush=True)
        prev = cur
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
