"""A checkpoint with crafted weights that makes the real engine emit a chosen token sequence.

How: every attention o_proj and every MLP down projection (dense, routed experts, shared experts) is
zero, so the residual stream at each position is just the current token's embedding. Script tokens
get orthogonal one-hot embeddings (value sqrt(hidden), so RMSNorm leaves them unchanged) and
`lm_head[next] = ALPHA * sum of embed[prev]` over the tokens whose successor is `next`. The greedy
(and, with a margin of ALPHA * 8 nats, practically any temperature) continuation of a script token is
its successor. Everything else (q/kv projections, routers, gate/up) is random, so all engine paths run.

The tokenizer is the embedded default model's, plus the multi-character script pieces as added tokens.
The script (after the V3 chat template's final `<｜Assistant｜>`):
    <think> Let me check the weather. </think> I will look it up. <tool calls block for get_weather>
    <｜end▁of▁sentence｜>
and EOS -> <think> again, so with ignore_eos the script cycles.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSET = os.path.join(ROOT, "deepinfer_jax", "assets", "default-model")
HIDDEN = 64
ALPHA = 4.0

REASONING = "Let me check the weather."
CONTENT = "I will look it up."
TOOL_NAME = "get_weather"
ARGS = '{"city": "Paris"}'
ADDED = [REASONING, CONTENT, "function", TOOL_NAME, "\n```json\n", ARGS, "\n```"]
SCRIPT = ["<｜Assistant｜>", "<think>", REASONING, "</think>", CONTENT, "<｜tool▁calls▁begin｜>",
          "<｜tool▁call▁begin｜>", "function", "<｜tool▁sep｜>", TOOL_NAME, "\n```json\n", ARGS, "\n```",
          "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<｜end▁of▁sentence｜>", "<think>"]
TOOLS = [{"type": "function", "function": {
    "name": TOOL_NAME, "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _tool_module():
    spec = importlib.util.spec_from_file_location("make_default_model", os.path.join(ROOT, "tools", "make_default_model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_scripted_model(out: str) -> dict:
    """Write the scripted checkpoint into `out`; returns {token string: id} for the script tokens."""
    from tokenizers import AddedToken, Tokenizer

    mdm = _tool_module()
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer.from_file(os.path.join(ASSET, "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.save(os.path.join(out, "tokenizer.json"))
    shutil.copy(os.path.join(ASSET, "tokenizer_config.json"), out)
    vocab = tok.get_vocab_size()
    ids = {t: tok.token_to_id(t) for t in SCRIPT}
    assert all(i is not None for i in ids.values()), ids
    config = mdm.model_config(vocab, HIDDEN)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    rng = np.random.default_rng(1234)
    w = mdm.random_weights(config, rng)
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = np.zeros_like(w[name])
    uniq = list(dict.fromkeys(ids.values()))
    assert len(uniq) <= HIDDEN
    emb = rng.normal(0.0, 1.0, (vocab, HIDDEN)).astype(np.float32)
    emb[uniq] = 0.0
    for k, tid in enumerate(uniq):
        emb[tid, k] = np.sqrt(HIDDEN)
    head = np.zeros((vocab, HIDDEN), np.float32)
    for prev, nxt in zip(SCRIPT[:-1], SCRIPT[1:]):
        head[ids[nxt]] += ALPHA * emb[ids[prev]] / np.sqrt(HIDDEN)
    w["model.embed_tokens.weight"], w["lm_head.weight"] = emb, head
    mdm.write_safetensors(os.path.join(out, "model.safetensors"), w, dtype="F32")
    return ids
