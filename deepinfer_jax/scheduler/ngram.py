"""N-gram prompt lookup: speculative proposals from a request's own tokens, on the host (no device work).

For n from `max_n` down to `min_n`, the last n tokens of the sequence (prompt + outputs) are searched for earlier
in the sequence; at the latest earlier match, the (up to) k tokens that followed it are the proposal. The first n
that matches wins (a longer context match is the better predictor). No match: no proposal (the sequence decodes
one token as usual).
"""

from __future__ import annotations


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` proposed next tokens for the sequence `tokens`, or [] when no n-gram of length min_n..max_n at
    its end occurs earlier in it."""
    length = len(tokens)
    last = tokens[-1] if tokens else None
    for n in range(min(max_n, length - 1), max(min_n, 1) - 1, -1):
        suffix = tokens[length - n:]
        # windows ending at e = length - 2 down to n - 1 (the suffix itself excluded); the last token first
        for e in range(length - 2, n - 2, -1):
            if tokens[e] == last and tokens[e - n + 1: e + 1] == suffix:
                return tokens[e + 1: e + 1 + k]
    return []
