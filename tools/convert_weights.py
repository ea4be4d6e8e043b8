#!/usr/bin/env python
"""HF safetensors -> orbax checkpoint. A thin wrapper over `deepinfer_jax.weights.convert` that works
from a clone (no install needed); the same CLI is `deepinfer convert`. See `--help`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepinfer_jax.weights.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
