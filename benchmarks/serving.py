"""Protocol B / C (BENCHMARKS.md) against a running `deepinfer serve`: the same as `deepinfer bench serve`.

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --input-len 512 --output-len 128 \
        --max-concurrency 1,8,32,128 [--dataset shared-prefix --shared-prefix-len 2048] [--result-file out.json]

The client logic lives in deepinfer_jax/server/bench.py (`run_serving` for use from Python).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepinfer_jax.server.bench import main, run_serving  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
