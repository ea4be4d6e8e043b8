"""LLMEngine: add / step / abort over the scheduler, the runner and the text layer.

One engine owns one scheduler and one runner; it is not thread-safe (the async engine runs it on one
loop thread). `step()` plans, runs one device step, appends the sampled tokens, detokenizes, applies
stop strings and returns a RequestOutput for every request that progressed, shaped by its
SamplingParams.output_kind (cumulative, only what is new, or only the final output).

n > 1: a user request becomes n child requests ("{id}#{i}") sharing the prompt (the prefix cache
shares its pages); outputs are gathered under the parent id with CompletionOutput.index = i.

Sharded (`sharding`, a deepinfer_jax.sharding.ModelSharding): the runner places everything on the mesh;
with data-parallel attention each rank gets its own scheduler and page pool (sharding/data_parallel.py),
`num_pages` counts pages per rank, and max_num_seqs / max_num_batched_tokens hold per rank.

Structured output (SamplingParams.structured_outputs): each child gets a grammar matcher (text/grammar.py) at
add_request, which raises ValueError if the grammar does not compile. A step with such a request samples in the
mask (or full) variant, whose allowed-token bitmask the runner fills from the matchers (no tokenizer: no bitmask);
since the mask of step N needs the token of step N-1, the runner queues N's forward first, then the engine fetches
N-1 (its ids, grammars and token stops; its text and outputs come after the dispatch) and the runner fills the masks
and queues N's sampler, so the host's mask work overlaps N's forward on the device. Each fetched token advances the
matcher; the request finishes ("stop") once its grammar is complete and takes nothing more.

Speculative decoding (`speculative_config`, config.SpeculativeConfig; docs/speculative.md): before each plan the
engine proposes drafts (Request.spec_token_ids: n-gram lookup, or `drafter`'s model) for the requests that decode;
the scheduler verifies as many as fit, their K + 1 positions in the same ragged step as everything else; the
runner's rejection sampler keeps the target distribution (sampling/rejection.py) and a sequence takes its
accepted drafts and one token of the target's. Since the next plan needs how many were accepted, every step is
fetched before the next is planned (no placeholders), as a structured-output step is; its text and outputs are made
after the next step is queued (with RunnerConfig.spec_overlap, `deepseek_mtp` steps are planned before the one in
flight is fetched: engine/spec_overlap.py). Requests with a grammar do not speculate. `spec_stats` counts drafts and acceptances (vLLM's spec_decode metrics).

Pipeline parallelism: one group of requests a stage, taken in turn by `step()`, each with its own step in flight
(engine/decode_groups.py; `max_steps_in_flight`: the most left in flight between two steps).

`params`: the loaded params, or a weights.pending.PendingParams (what `LLM` passes): the engine sizes the KV
cache counting their bytes, then starts their load, which runs while the runner compiles its step programs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any

import numpy as np

from deepinfer_jax.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig, SpeculativeConfig
from deepinfer_jax.config_v4 import with_mtp_cache
from deepinfer_jax.runner.device_memory import given_memory, pages_for_memory, v4_pools
from deepinfer_jax.runner.kv_transfer import host_tier_blocks
from deepinfer_jax.runner.inputs import Shapes, placeholder, token_buckets
from deepinfer_jax.engine.decode_groups import grouped_step, set_decode_groups
from deepinfer_jax.engine.outputs import prompt_logprobs, request_output, sampled_logprobs
from deepinfer_jax.engine.request_state import Child as _Child, Parent as _Parent
from deepinfer_jax.engine.speculative import drafter_for, spec_shapes, spec_state, speculative_step
from deepinfer_jax.engine import spec_overlap
from deepinfer_jax.runner.pipeline import kv_sizing_config, runner_class  # ModelRunner, or PipelineRunner
from deepinfer_jax.runner.multihost import agree_min
from deepinfer_jax.runner.weight_offload import offload as offload_weights
from deepinfer_jax.scheduler import Scheduler
from deepinfer_jax.scheduler.kv_cache_manager import cdiv
from deepinfer_jax.text.grammar import mask_words
from deepinfer_jax.types import MAX_LOGIT_BIAS, Logprob, Request, RequestOutput, RequestStatus, SamplingParams
from deepinfer_jax.weights.pending import PendingParams

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, cfg: ModelConfig, params: Any, tokenizer: Any, *, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, runner_config: RunnerConfig, num_pages: int | None = None,
                 progress: bool = True, max_logprobs: int = 20, sharding: Any = None,
                 speculative_config: SpeculativeConfig | dict | str | None = None, load_format: str = "auto"):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.spec = SpeculativeConfig.parse(speculative_config)
        if self.spec is not None:
            self.spec.check_supported()
            self.spec.check_parallel(getattr(sharding, "pipeline_parallel_size", 1))
        self.spec_stats, self.mtp_proposer = spec_state(self.spec)  # counters; `deepseek_mtp`'s drafts (or None)
        if self.mtp_proposer and cfg.family == "deepseek_v4" and cfg.has_mtp:  # the pools hold the MTP layer's rows
            self.cfg = cfg = with_mtp_cache(cfg)
        self.drafter = drafter_for(self.spec, cfg, tokenizer, runner_config, scheduler_config.max_model_len, load_format)
        self.scheduler_config, self.cache_config = scheduler_config, cache_config
        self.max_model_len = scheduler_config.max_model_len
        ps = cache_config.page_size
        max_pages = cdiv(self.max_model_len, ps)
        # The KV cache's host tier (scheduler/host_tier.py, runner/kv_transfer.py): pages in host memory.
        self.num_host_blocks = 0
        if cache_config.kv_offloading_size:
            if sharding is not None and sharding.num_ranks > 1:
                raise ValueError("kv_offloading_size is not supported with data-parallel attention "
                                 "(--data-parallel-size > 1)")
            self.num_host_blocks = host_tier_blocks(cfg, ps, runner_config.kv_dtype, cache_config.kv_offloading_size)
        # Params may still be to load (weights/pending.py): their bytes count as in use, and they load (on a thread
        # of their own) from here on, while the runner lowers and compiles the step programs.
        params, self.offloaded_weight_bytes = offload_weights(params, cache_config.cpu_offload_gb, sharding)
        pending = params if isinstance(params, PendingParams) else None
        if num_pages is None:
            fallback = scheduler_config.max_num_seqs * max_pages + 1
            memory = None if cache_config.gpu_memory_gib is None else given_memory(cache_config.gpu_memory_gib)
            num_pages, how = pages_for_memory(
                kv_sizing_config(cfg, sharding), ps, runner_config.kv_dtype, cache_config.gpu_memory_utilization,
                fallback, loading=pending, memory=memory,
                extra_bytes_per_page=self.drafter.bytes_per_page(ps, sharding) if self.drafter else 0)
            if sharding is not None:  # several hosts: one cache shape everywhere, the fewest pages any host fits
                agreed = agree_min(num_pages)
                if agreed != num_pages:
                    num_pages, how = agreed, f"{agreed} pages (the fewest of the hosts; this one fits {num_pages})"
            if self.mtp_proposer and num_pages != fallback and cfg.family != "deepseek_v4":  # MTP KV: one more layer
                num_pages, how = self.mtp_proposer.pages(cfg, num_pages, how)
        else:
            how = f"{num_pages} pages (set explicitly)"
        self.cache_pools, how = (v4_pools(cfg, num_pages, how, ps, scheduler_config, runner_config)  # a pool per group
                                 if cfg.family == "deepseek_v4" else (None, how))
        if pending is not None:
            pending.start()
        # No cap for the Pallas kernels: their loads from a cache over 4 GiB use 64-bit offsets
        # (tests/kernels/test_kernel_lowering.py checks the Triton IR).
        if sharding is not None and sharding.num_ranks > 1:
            how += f" per data-parallel rank, {sharding.num_ranks} ranks"
        if self.num_host_blocks:
            how += f"; host tier {self.num_host_blocks} pages ({cache_config.kv_offloading_size} GiB)"
        # RunnerConfig.spec_overlap: the overlapped speculating loop (engine/spec_overlap.py), or a one-line refusal;
        # the runner gets the decision
        self.spec_overlap = spec_overlap.check(self.spec, runner_config, sharding, self.cache_pools,
                                               bool(self.num_host_blocks))
        runner_config = dataclasses.replace(runner_config, spec_overlap=self.spec_overlap)
        self._overlap = None  # its optimistic step in flight: (plan, (HostStep, StepOut), {request id: row})
        self.num_overlapped_steps = 0  # steps planned before the one in flight was fetched
        log.info("KV cache: %s", how)
        self.kv_cache_report = how
        buckets = tuple(sorted(runner_config.token_buckets)) or token_buckets(
            scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs)
        need = max(scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs)
        if buckets[-1] < need:
            raise ValueError(f"the largest token bucket {buckets[-1]} is below max(max_num_batched_tokens, "
                             f"max_num_seqs) = {need}")
        self.shapes = Shapes(buckets, scheduler_config.max_num_seqs, max_pages, ps, self.max_model_len,
                             mask_words=mask_words(cfg.vocab_size) if tokenizer is not None else 0,
                             max_logit_bias=MAX_LOGIT_BIAS, kv_pools=self.cache_pools, **spec_shapes(self.spec))
        if sharding is not None and sharding.num_ranks > 1:
            from deepinfer_jax.sharding.data_parallel import DPScheduler

            self.scheduler = DPScheduler([Scheduler(scheduler_config, cache_config, num_pages)
                                          for _ in range(sharding.num_ranks)])
        else:
            self.scheduler = Scheduler(scheduler_config, cache_config, num_pages, self.num_host_blocks, self.cache_pools)
        self.runner = runner_class(sharding)(cfg, params, runner_config, self.shapes, num_pages, max_logprobs,
                                             sharding=sharding)
        if self.num_host_blocks:
            self.runner.enable_host_tier(self.num_host_blocks)
        self.num_warmup_compiles = self.runner.warmup(progress=progress)
        self.expert_balance = None  # engine/expert_balance.py: with enable_eplb, set by LLM
        self.num_warmup_compiles += self.drafter.start(self.shapes, num_pages, progress, sharding) if self.drafter else 0
        self._rng = np.random.default_rng(runner_config.seed)
        self._seeds: dict[str, int] = {}
        self._parents: dict[str, _Parent] = {}
        self._child_parent: dict[str, str] = {}
        self._counter = itertools.count()
        self._pending = None  # (in-flight step, [(request, placeholder index)]) not yet fetched
        self.num_steps, self.step_seconds = 0, 0.0  # `step` calls and their seconds (step_counters)
        self._spec_unemitted: list = []  # speculation: the last fetched step's tokens, emitted after the next dispatch
        self.max_steps_in_flight = 0
        # one decode group a pipeline stage: the next group to step, and each group's `_pending`
        self.set_decode_groups(getattr(self.runner, "decode_groups", 1) if self.spec is None else 1)
        self.eos_token_ids = tuple(cfg.eos_token_ids) or tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        if tokenizer is not None and getattr(tokenizer, "eos_token_ids", None):
            self.eos_token_ids = tuple(dict.fromkeys(self.eos_token_ids + tuple(tokenizer.eos_token_ids)))
        self._grammars = None  # text.grammar.GrammarCompiler
        if getattr(tokenizer, "backend_kind", None) == "tokenizers":
            # Its pass over the vocabulary holds the GIL (about 1.4 s at 102,400 tokens): here, not in a step.
            # A tokenizer llguidance cannot take only refuses structured-output requests (each one with this
            # error), never the engine's start.
            try:
                self.grammar_compiler.ll_tokenizer  # noqa: B018
            except ValueError as e:
                log.warning("structured output is unavailable for this model: %s", e)

    @property
    def grammar_compiler(self):
        """The structured-output compiler over this engine's tokenizer and vocabulary (made on first use)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the engine's tokenizer")
            from deepinfer_jax.text.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.cfg.vocab_size, self.eos_token_ids)
        return self._grammars

    # ---- requests --------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._counter))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None,
                    keep_special_tokens: tuple[str, ...] = ()) -> None:
        """Queue a request. `keep_special_tokens`: special tokens kept in the text even when
        skip_special_tokens is set (the reasoning / tool-call parsers need their markers)."""
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.cfg.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range [0, {vocab})")
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is out of range [0, {vocab})")
        self.check_held_back(params)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_token_ids)
        if len(prompt_token_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})")
        if max_tokens < 1:
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) leaves no room to generate "
                             f"within max_model_len ({self.max_model_len})")
        n = params.best_of or params.n  # sequences sampled; the best `params.n` of them are returned
        spec = params.structured_outputs
        grammars = [self.grammar_compiler.matcher(spec) for _ in range(n)] if spec is not None else None
        arrival = time.time() if arrival_time is None else arrival_time
        # best_of ranks its sequences by cumulative logprob, which needs the sampled tokens' logprobs.
        hide = n > params.n and params.logprobs is None
        parent = _Parent(request_id, prompt, list(prompt_token_ids), n=params.n, hide_logprobs=hide)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = self._prompt_logprobs(prompt_token_ids, params.prompt_logprobs)
        child_params = dataclasses.replace(params, n=1, best_of=None, max_tokens=max_tokens,
                                           logprobs=0 if hide else params.logprobs, prompt_logprobs=None)
        for i in range(n):
            cid = request_id if n == 1 else f"{request_id}#{i}"
            req = Request(cid, list(prompt_token_ids), child_params, arrival_time=arrival,
                          eos_token_ids=self.eos_token_ids, grammar=grammars[i] if grammars else None)
            seed = params.seed + i if params.seed is not None else int(self._rng.integers(0, 2**63))
            self._seeds[cid] = seed
            lp = child_params.logprobs is not None
            child = _Child(req, i, logprobs=[] if lp else None, cumulative_logprob=0.0 if lp else None)
            if self.tokenizer is not None:
                from deepinfer_jax.text import IncrementalDetokenizer, StopStringMatcher

                child.detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                     skip_special_tokens=params.skip_special_tokens,
                                                     keep_special_tokens=keep_special_tokens)
                child.stopper = StopStringMatcher(params.stop or [], params.include_stop_str_in_output)
            parent.children.append(child)
            self._child_parent[cid] = request_id
        self._parents[request_id] = parent
        for child in parent.children:
            self.scheduler.add_request(child.request)

    def check_held_back(self, params: SamplingParams) -> None:
        """ValueError when min_tokens would hold back more stop_token_ids and EOS ids than the sampler masks
        (Shapes.max_suppress). Reads only what is fixed at start, so AsyncEngine.submit calls it on its caller's
        thread (a server's refusal comes before its stream starts)."""
        cap = self.shapes.max_suppress
        held = len(params.stop_token_ids or ()) + (0 if params.ignore_eos else len(self.eos_token_ids))
        if params.min_tokens and held > cap:
            raise ValueError(f"with min_tokens, at most {cap} stop_token_ids and EOS ids can be held back; this "
                             f"request has {held}")

    def _prompt_logprobs(self, prompt_token_ids: list[int], k: int) -> list[dict[int, Logprob] | None]:
        """Each prompt token's logprob given the ones before it, then the top k (engine/outputs.py)."""
        return prompt_logprobs(prompt_token_ids, self.runner.score_prompt(list(prompt_token_ids)), k)

    def abort_request(self, request_id: str) -> bool:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return False
        for child in parent.children:
            self.scheduler.abort_request(child.request.request_id)
            self._forget(child.request.request_id)
        return True

    def _forget(self, cid: str) -> None:
        self._seeds.pop(cid, None)
        self._child_parent.pop(cid, None)
        self.runner.page_rows.forget(cid)

    def has_unfinished_requests(self) -> bool:
        # A pending step holding only aborted requests needs no more steps (the next one drops it).
        return bool(self._parents)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan and dispatch step N, then finish step N-1 while N runs on the device.

        Step N is planned before step N-1's ids are known: each sampled id first enters the request
        as a placeholder (runner/inputs.py `placeholder`) that the device resolves from N-1's output,
        and the host patches the real id in once N-1 is fetched. EOS, stop ids and stop strings are
        checked at that point, so a request that stopped at N-1 may still be computed once in N: that
        work is dropped (the scheduler skips finished requests). Outputs are those of step N-1.
        With speculative decoding each step is planned, run and fetched in turn, its text and outputs made while
        the next one runs (engine/speculative.py)."""
        t = time.perf_counter()
        try:
            if self.spec is not None:
                return spec_overlap.overlapped_step(self) if self.spec_overlap else speculative_step(self)
            return self._step() if self.groups == 1 else grouped_step(self)
        finally:
            self.num_steps += 1
            self.step_seconds += time.perf_counter() - t

    def step_counters(self) -> tuple[int, float, float]:
        """(`step` calls, seconds in them, seconds of those in the runner's `fetch`, waiting for the device's
        results) since the engine started: the host's share of a step is the difference."""
        return self.num_steps, self.step_seconds, self.runner.fetch_seconds

    def set_decode_groups(self, n: int) -> None:
        """Steps in flight with pipeline parallelism: `n` groups, 1 (one step at a time) up to the stages (the
        default); engine/decode_groups.py. Only while idle."""
        set_decode_groups(self, n)

    def _step(self, group: int = 0) -> list[RequestOutput]:
        """`step` for one group's requests (all of them with one group)."""
        plan = self.scheduler.schedule(group)
        self.runner.apply_kv_transfers(getattr(plan, "kv_transfers", None))  # host tier: before the step
        inflight = None
        fetched = None
        if not plan.is_empty:
            requests = {s.request_id: self.scheduler.requests[s.request_id] for s in plan.seqs}
            # A grammar's mask for this step needs the token of the step in flight: the runner fetches it (ids,
            # grammars, token stops; text and outputs after the dispatch) once this step's forward is queued.
            box = []
            grammar = self._pending is not None and any(s.sample and requests[s.request_id].grammar is not None
                                                        for s in plan.seqs)
            try:
                inflight = self.runner.dispatch(plan.seqs, requests, self._seeds, getattr(plan, "ranks", None),
                                                before_sampling=(lambda: box.append(self._fetch_pending()))
                                                if grammar else None)
            except Exception:
                self._fail_plan(plan)
                raise
            fetched = box[0] if box else None
        outputs = self._emit(self._fetch_pending() if fetched is None else fetched)
        if inflight is not None:
            host = inflight[0]
            row_of = {host.request_ids[r]: r for r in host.sample_rows}
            sampled = {rid: placeholder(row) for rid, row in row_of.items()}
            updates = self.scheduler.update_from_output(plan, sampled)
            # (request, index of its placeholder) for every request that sampled this step.
            self._pending = (inflight, [(req, len(req.output_token_ids) - 1) for req, _, _ in updates])
        return outputs

    def _fetch_pending(self) -> list:
        """Fetch the last dispatched step and patch its ids into the requests, advancing their grammars and
        applying EOS and stop ids: [(request, token, its logprobs, parent id)] for `_emit`."""
        if self._pending is None:
            return []
        inflight, patches = self._pending
        self._pending = None
        result = self.runner.fetch(inflight)
        fetched = []
        for req, index in patches:
            token = result.token_ids[req.request_id]
            req.output_token_ids[index] = token
            pid = self._child_parent.get(req.request_id)
            if pid is None:  # aborted meanwhile
                continue
            if req.grammar is not None and not req.is_finished:
                self._advance_grammar(req, token)
            if not req.is_finished:
                self._check_token_stop(req)
            lp = result.logprobs.get(req.request_id)
            fetched.append((req, [token], None if lp is None else [lp], pid))
        return fetched

    def _emit(self, fetched: list) -> list[RequestOutput]:
        """Text (detokenized, stop strings) and the outputs of the requests `_fetch_pending` patched: `fetched` holds
        (request, its new tokens, their logprobs or None, parent id). A stop string met before the last of several
        new tokens (speculation) drops the tokens after it."""
        touched: dict[str, None] = {}
        for req, tokens, lps, pid in fetched:
            parent = self._parents.get(pid)
            if parent is None:  # aborted meanwhile
                continue
            child = parent.children[0] if len(parent.children) == 1 else parent.children[int(req.request_id.rsplit("#", 1)[1])]
            for i, token in enumerate(tokens):
                last = i == len(tokens) - 1
                self._append(child, [token], None if lps is None else lps[i], last)
                if not last and child.stopper is not None and child.stopper.stopped:
                    del req.output_token_ids[len(req.output_token_ids) - (len(tokens) - 1 - i):]
                    if req.status != RequestStatus.FINISHED_STOPPED or req.stop_reason != child.stopper.matched:
                        # finished by a later token's length or EOS already: the stop string came first
                        req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, child.stopper.matched
                    break
            touched[pid] = None
        outputs = (self._output(pid) for pid in touched if pid in self._parents)
        return [out for out in outputs if out is not None]

    def _advance_grammar(self, req: Request, token: int) -> None:
        """Feed a sampled token to the request's grammar; finish the request ("stop") once the grammar is
        complete and takes nothing more (or, which the mask rules out, rejects the token)."""
        g = req.grammar
        if token in req.eos_token_ids and g.is_accepting():
            return  # EOS where the grammar allows it: _check_token_stop finishes the request
        if not g.accept(token):
            log.error("request %s: token %d breaks its grammar (%s); finishing it", req.request_id, token, g.error)
            self.scheduler.finish_request(req.request_id, "stop")
        elif g.is_terminated():
            self.scheduler.finish_request(req.request_id, "stop")

    def _check_token_stop(self, req: Request) -> None:
        """EOS (unless ignore_eos) and stop_token_ids, once min_tokens outputs exist (vLLM's rules;
        the scheduler already applied the length limits when the placeholder went in)."""
        sp = req.sampling_params
        if req.num_output_tokens < sp.min_tokens:
            return
        token = req.output_token_ids[-1]
        if not sp.ignore_eos and token in req.eos_token_ids:
            self.scheduler.finish_request(req.request_id, "stop")
        elif sp.stop_token_ids and token in sp.stop_token_ids:
            self.scheduler.finish_request(req.request_id, "stop", stop_reason=token)

    def _fail_plan(self, plan) -> None:
        """A step that could not run: abort its requests so the scheduler is consistent again."""
        for seq in plan.seqs:
            pid = self._child_parent.get(seq.request_id)
            if pid is not None:
                self.abort_request(pid)
        self.scheduler.update_from_output(plan, {})

    def _append(self, child: _Child, new_ids: list[int], lp, last: bool = True) -> None:
        """Logprobs and text of one new token (`new_ids`: [it]); `last`: no more tokens of this step follow, so a
        finished request's text is flushed."""
        req = child.request
        if child.logprobs is not None and lp is not None:
            child.logprobs.append(sampled_logprobs(new_ids[-1], lp, req.sampling_params.logprobs or 0))
            child.cumulative_logprob += lp[0]
        if child.detok is None:
            return
        parts = child.text_parts
        parts.append(child.stopper.feed(child.detok.add(new_ids)))
        if child.stopper.stopped and not req.is_finished:
            self.scheduler.finish_request(req.request_id, "stop", stop_reason=child.stopper.matched)
        elif child.stopper.stopped and req.status == RequestStatus.FINISHED_LENGTH:
            # the token that met max_tokens also completed a stop string: the text ends at the stop string (vLLM)
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, child.stopper.matched
        if req.is_finished and not child.stopper.stopped and last:
            parts.append(child.stopper.feed(child.detok.flush()))
            parts.append(child.stopper.flush())

    def _output(self, pid: str) -> RequestOutput | None:
        """The parent's output after a step (engine/outputs.py); a finished parent is forgotten."""
        parent = self._parents[pid]
        out = request_output(parent)
        if out is not None and out.finished:
            del self._parents[pid]
            for c in parent.children:
                self._forget(c.request.request_id)
        return out

    # ---- stats -----------------------------------------------------------------------------------
    def stats(self):
        """The scheduler's SchedulerStats, with a snapshot of `spec_stats` when speculating."""
        st = self.scheduler.stats()
        if self.spec_stats is None:
            return st
        spec = dataclasses.replace(self.spec_stats)
        spec.num_accepted_tokens_per_pos = list(self.spec_stats.num_accepted_tokens_per_pos)
        return dataclasses.replace(st, spec_decode=spec)

    def memory_report(self) -> dict:
        """Device memory and device facts (ModelRunner.memory_report)."""
        return self.runner.memory_report()

    def expert_load_report(self) -> dict | None:
        """With enable_eplb, the observed expert load (ExpertBalance.report); None otherwise."""
        return None if self.expert_balance is None else self.expert_balance.report()
