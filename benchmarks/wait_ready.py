"""Wait until a server answers GET /health: `python3 benchmarks/wait_ready.py URL [SECONDS] [PID]`.
Prints the seconds waited; exits 1 if it never answered, at once when process PID (the server) has ended."""

from __future__ import annotations

import os
import sys
import time
import urllib.request


def alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a child of ours that exited but was not reaped yet still "exists"
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def main(argv: list[str]) -> int:
    url, limit = argv[0], float(argv[1]) if len(argv) > 1 else 600.0
    pid = int(argv[2]) if len(argv) > 2 else None
    t0 = time.time()
    while time.time() - t0 < limit:
        try:
            urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2)
            print(f"{time.time() - t0:.1f}")
            return 0
        except Exception:  # noqa: BLE001 - not up yet
            if not alive(pid):
                print(f"the server (pid {pid}) ended after {time.time() - t0:.1f} s without answering")
                return 1
            time.sleep(0.5)
    print(f"no answer within {limit:.0f} s")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
