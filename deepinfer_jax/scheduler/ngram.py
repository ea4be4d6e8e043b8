"""N-gram prompt lookup: speculative proposals from a request's own tokens, on the host (no device work).

For n from `max_n` down to `min_n`, the last n tokens of the sequence (prompt + outputs) are searched for earlier
in the sequence; at the latest earlier match, the (up to) k tokens that followed it are the proposal. The first n
that matches wins (a longer context match is the better predictor). No match: no proposal (the sequence decodes
one token as usual).
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` proposed next tokens for the sequence `tokens` (ints), or [] when no n-gram of length
    min_n..max_n at its end occurs earlier in it."""
    seq = np.asarray(tokens, np.int64)
    length = len(seq)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        if n < 1:
            break
        suffix = seq[length - n:]
        # windows starting at 0 .. length - n - 1 (the suffix itself excluded): equal where every column matches
        starts = np.ones(length - n, bool)
        for j in range(n):
            starts &= seq[j: length - n + j] == suffix[j]
        hits = np.flatnonzero(starts)
        if hits.size:
            follow = int(hits[-1]) + n
            return seq[follow: follow + k].tolist()
    return []
