"""Wait until a server answers GET /health: `python3 benchmarks/wait_ready.py URL [SECONDS]`.
Prints the seconds waited; exits 1 if it never answered."""

from __future__ import annotations

import sys
import time
import urllib.request


def main(argv: list[str]) -> int:
    url, limit = argv[0], float(argv[1]) if len(argv) > 1 else 600.0
    t0 = time.time()
    while time.time() - t0 < limit:
        try:
            urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2)
            print(f"{time.time() - t0:.1f}")
            return 0
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.5)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
