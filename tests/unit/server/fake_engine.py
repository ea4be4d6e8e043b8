"""A pure-Python stand-in for LLMEngine (same add / step / abort / stats surface, no JAX).

Each running request emits one token per step: token = (last token + 1) % vocab, text "t{token} ";
it finishes with "length" at max_tokens, or "stop" on a stop_token_id. Outputs are cumulative, or
only each step's new token under RequestOutputKind.DELTA (what AsyncEngine asks for). `step_delay` makes steps slow,
`fail_next_step` makes the next step raise. Counts calls so tests can see that an idle loop sleeps.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from deepinfer_jax.types import CompletionOutput, Logprob, RequestOutput, RequestOutputKind


@dataclass
class Stats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    spec_decode: object = None  # as SchedulerStats: no speculation


class _SchedCfg:
    def __init__(self, max_num_seqs):
        self.max_num_seqs = max_num_seqs


class _Cfg:
    def __init__(self, vocab):
        self.vocab_size = vocab


class FakeEngine:
    def __init__(self, *, max_num_seqs: int = 4, max_model_len: int = 64, vocab: int = 100, step_delay: float = 0.0):
        self.scheduler_config = _SchedCfg(max_num_seqs)
        self.max_model_len = max_model_len
        self.cfg = _Cfg(vocab)
        self.step_delay = step_delay
        self.fail_next_step = False
        self.reqs: dict[str, dict] = {}
        self.steps = 0
        self.idle_checks = 0
        self.aborted: list[str] = []
        self.lock = threading.Lock()

    def check_held_back(self, params) -> None:
        """LLMEngine's check of min_tokens' held-back ids (tests/engine): this fake's sampler holds back none."""

    def add_request(self, request_id, prompt_token_ids, params, prompt=None, arrival_time=None,
                    keep_special_tokens=()):
        if request_id in self.reqs:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        mt = params.max_tokens or (self.max_model_len - len(prompt_token_ids))
        self.reqs[request_id] = {"prompt": list(prompt_token_ids), "params": params, "max": mt,
                                 "children": [{"ids": [], "text": "", "lps": [], "fin": None}
                                              for _ in range(params.n)], "cached": 0}

    def abort_request(self, request_id) -> bool:
        self.aborted.append(request_id)
        return self.reqs.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        self.idle_checks += 1
        return bool(self.reqs)

    def running(self) -> list[str]:
        return list(self.reqs)[: self.scheduler_config.max_num_seqs]

    def step(self):
        self.steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        outs = []
        for rid in self.running():
            r = self.reqs[rid]
            fresh = []  # (index, token) of the children that progressed this step
            for i, c in enumerate(r["children"]):
                if c["fin"]:
                    continue
                last = (c["ids"] or r["prompt"])[-1]
                tok = (last + 1) % self.cfg.vocab_size
                c["ids"].append(tok)
                c["text"] += f"t{tok} "
                if r["params"].logprobs is not None:
                    c["lps"].append({tok: Logprob(-0.5, 1), (tok + 1) % self.cfg.vocab_size: Logprob(-1.5, 2)})
                if tok in r["params"].stop_token_ids:
                    c["fin"] = "stop"
                elif len(c["ids"]) >= r["max"]:
                    c["fin"] = "length"
                fresh.append(i)
            finished = all(c["fin"] for c in r["children"])
            lp = r["params"].logprobs is not None
            if r["params"].output_kind == RequestOutputKind.DELTA:  # the new token of each child that moved
                cs = [CompletionOutput(i, f"t{c['ids'][-1]} ", c["ids"][-1:], c["lps"][-1:] if lp else None, c["fin"])
                      for i, c in ((i, r["children"][i]) for i in fresh)]
            else:
                cs = [CompletionOutput(i, c["text"], list(c["ids"]), list(c["lps"]) if lp else None, c["fin"])
                      for i, c in enumerate(r["children"])]
            outs.append(RequestOutput(rid, None, r["prompt"], r["cached"], cs, finished))
            if finished:
                del self.reqs[rid]
        return outs

    def stats(self):
        n = len(self.reqs)
        run = min(n, self.scheduler_config.max_num_seqs)
        return Stats(run, n - run, run / 10.0)
