"""Server unit tests: no JAX. `fake_engine.py` stands in for LLMEngine."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
