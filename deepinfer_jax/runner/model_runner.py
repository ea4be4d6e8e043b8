"""The device side of a step: params and the paged KV cache, one jitted program per step.

`ModelRunner.execute(plan, requests, seeds)` pads the plan (runner/inputs.py) and queues one program:
the forward of the step's token bucket (the KV cache donated and updated in place) and the sampler,
which reads the logits of each sequence's last token on the device (logits never leave it). It returns
the sampled token ids (and logprobs) for the rows that sample.

Variants: for each token bucket, a base sampler (no penalties, no top-k / top-p, no top logprobs) and
a full one (penalty history arrays, logit_bias, the structured-output bitmask, the top-k / top-p sort, top
`max_logprobs` logprobs), for decode buckets (RunnerConfig.greedy_variant) a greedy one (every row greedy: no
draw), and where a step's forward may be a program of its own (`has_mask_variant`) a mask one: the base sampler
and the bitmask, for steps whose constrained rows need nothing else of the full variant. The host picks one per
step (inputs.needs_full_variant, `prepare`), so the step has no device-side branch. A bucket's programs share
the forward's trace; with RunnerConfig.prefill_shared_forward a prefill bucket's variants share its compiled
forward too, each step then the forward and the variant's sampler as two programs, and so do every bucket's full
and mask variants (their masks are filled while the forward runs). runner/step_programs.py
makes and holds the programs and their resident buffers. `warmup()` compiles all of them (runner/warmup.py, which
calls the public methods below the warm-up heading); afterwards `CompileCounter` sees every backend compile (or
persistent-cache load) during this runner's steps, and `compiles_after_warmup` must stay 0 (tests assert it;
production logs a warning).

`params` may still be loading (a weights.pending.PendingParams): on one device the runner then holds their abstract
tree, from which warm-up lowers and compiles every program, and takes the arrays before the first step runs
(`await_params`).

Sharded (`sharding`, a deepinfer_jax.sharding.ModelSharding): the params and the KV cache are placed on
their shardings, the step's inputs are constrained to theirs inside the jit (token arrays and rows over
the data axis) and the model gets the mesh rules. With data-parallel attention (`sharding.num_ranks`
> 1) `num_pages` is per rank, the cache holds num_ranks x num_pages pages, and a step lays the ranks'
shares out rank after rank (sharding/data_parallel.py); `execute` then needs each seq's rank.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig, RunnerConfig
from deepinfer_jax.models.registry import family_of, init_kv_cache, kv_cache_shape
from deepinfer_jax.runner import program_cache, spec_mtp, warmup
from deepinfer_jax.runner.compile_cache import CompileCounter
from deepinfer_jax.runner.device_memory import device_memory
from deepinfer_jax.runner.inputs import (HostStep, PageRows, Shapes, build_metadata, build_sampling, fill_masks,
                                         needs_full_variant, next_pow2)
from deepinfer_jax.runner.kv_transfer import KVTransfer
from deepinfer_jax.runner.lowering import speed_up_kernel_lowering
from deepinfer_jax.runner.packing import sizes
from deepinfer_jax.runner.prompt_scoring import PromptScorer
from deepinfer_jax.runner.step_io import StepOut, StepResult, extract_results, packed, step_result
from deepinfer_jax.runner.step_programs import StepPrograms
from deepinfer_jax.runner.weight_offload import host_bytes
from deepinfer_jax.sharding.data_parallel import merge_rank_steps
from deepinfer_jax.weights.pending import PendingParams

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: Any, runner_cfg: RunnerConfig, shapes: Shapes,
                 num_pages: int, max_logprobs: int = 20, sharding: Any = None):
        CompileCounter.install()
        speed_up_kernel_lowering()  # runner/lowering.py: less of warm-up's lowering on one thread
        # Params still loading (weights/pending.py): on one device warm-up lowers and compiles from their abstract
        # tree and takes the arrays before its runs (`await_params`); sharded, they are needed here.
        self._pending = None
        if isinstance(params, PendingParams):
            if sharding is None:
                self._pending, params = params, params.abstract
            else:
                params = params.result()
        self.cfg, self.params, self.runner_cfg, self.shapes = cfg, params, runner_cfg, shapes
        self.num_pages = num_pages
        self.max_logprobs = max_logprobs
        self.kv_dtype = jnp.dtype(runner_cfg.kv_dtype)
        self.sharding = sharding
        self.num_ranks = 1 if sharding is None else sharding.num_ranks
        if shapes.mtp_drafts:  # runner/spec_mtp.py: the MTP drafts on the device, its KV one more cache layer
            spec_mtp.check_supported(cfg, family_of(cfg).name, runner_cfg.collect_routing)
        # Prefill-bucket steps carry StepMetadata.has_context from the host (inputs.build_metadata) where their
        # program takes the split attention, whose context part it names (one device, the Pallas path).
        self._mark_context = (runner_cfg.prefill_context_variant and sharding is None
                              and family_of(cfg).splits_prefill_attention(cfg, runner_cfg.attn_impl, None,
                                                                          runner_cfg.prefill_attention))
        self.page_rows = PageRows()  # the running requests' page ids, converted once (`forget` drops one)
        if sharding is not None:  # a no-op for params already loaded onto their shardings
            self.params = jax.device_put(params, sharding.fit_param_shardings(cfg, params))
            if shapes.kv_pools is not None:  # a per-group cache (DeepSeek-V4): each pool on the layout's sharding
                self.kv_cache = tuple(jnp.zeros(s, self.kv_dtype, device=sharding.kv_cache)
                                      for s in kv_cache_shape(cfg, shapes.kv_pools, shapes.page_size))
            else:
                shape = kv_cache_shape(cfg, num_pages * self.num_ranks, shapes.page_size)
                if shapes.mtp_drafts:  # the MTP layer's latents as one more layer (runner/spec_mtp.py)
                    shape = spec_mtp.kv_cache_shape(shape)
                self.kv_cache = jnp.zeros(shape, self.kv_dtype, device=sharding.kv_cache)
        elif shapes.mtp_drafts and shapes.kv_pools is None:  # V4's pools hold the MTP layer already (mtp_in_cache)
            self.kv_cache = jnp.zeros(spec_mtp.kv_cache_shape(kv_cache_shape(cfg, num_pages, shapes.page_size)),
                                      self.kv_dtype)
        else:
            # a per-group cache (DeepSeek-V4): one array per pool of shapes.kv_pools
            self.kv_cache = init_kv_cache(cfg, shapes.kv_pools or num_pages, shapes.page_size, self.kv_dtype)
        self.max_rows = self.num_ranks * next_pow2(shapes.max_num_seqs)
        self.programs = StepPrograms(cfg, runner_cfg, shapes, num_pages, max_logprobs, sharding, self.max_rows)
        resident = self.programs.resident_sharding
        # The previous step's sampled ids stay on the device: the next step's placeholders read them.
        self._prev_tokens = jax.device_put(jnp.zeros(self.programs.prev_tokens.shape, jnp.int32), resident)
        if sharding is None:
            # uncommitted, the first cache made the first real step compile again
            self.kv_cache = jax.device_put(self.kv_cache, jax.devices()[0])
        self._stage = jax.jit(lambda inbox, host: jax.lax.dynamic_update_slice(inbox, host, (0,)),
                              donate_argnums=0, out_shardings=resident)
        self._extract = jax.jit(extract_results, static_argnums=(1, 2, 3))
        # RunnerConfig.count_expert_load: the token copies routed to each (MoE layer, logical expert) since warm-up,
        # int32 [num_moe_layers, E] on the device; each step's `_extract` makes a new array (never donated, so a
        # reader on another thread holds a valid one), read on the host only by `expert_load`.
        self._expert_load = None
        self.reset_expert_load()
        self._warm = False
        self._init_state()

    def _init_state(self) -> None:
        """The runner's state beside its programs and buffers: counters and what is made on first use."""
        # Several hosts (runner/multihost.py): on rank 0, the channel each step's inputs go to the other ranks by.
        self.channel = None
        self.last_routing = None
        self.last_num_tokens = 0
        self.compiles_after_warmup = 0  # compilations seen while this runner executed steps after warm-up
        self.fetch_seconds = 0.0  # time spent in `fetch`: waiting for dispatched steps' results
        self.steps_by_variant: Counter[str] = Counter()  # steps dispatched, by sampling variant (HostStep.variant)
        # The host's structured-output bitmask fills done while a step's forward ran (`run`'s before_sampling):
        # how many, their rows and seconds in all, and the last one's seconds.
        self.mask_fills = self.mask_fill_rows = 0
        self.mask_fill_seconds = self.last_mask_fill_seconds = 0.0
        self.programs_loaded = 0  # step programs warm-up loaded from RunnerConfig.program_cache_dir
        # Where the start's seconds went, as warm-up (runner/warmup.py) and `await_params` saw them: "weights" (their
        # load, on its own thread beside warm-up), "lowered" (warm-up's tracing and lowering, from its start),
        # "weights_waited" (warm-up's wait for them once lowered), "warmup" (all of warm-up).
        self.startup_seconds: dict[str, float | None] = {}
        self._scorer = None  # runner/prompt_scoring.py, made on the first request for prompt logprobs
        self.kv_transfer = None  # runner/kv_transfer.py, with a host tier (`enable_host_tier`)

    # ---- reporting ---------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, Any]:
        """Device memory in bytes, for /metrics: the weights, the KV cache, and (where the backend reports them,
        runner/device_memory.py) the allocator's limit and bytes in use, summed over this runner's devices;
        plus the platform and device kind, and with a host tier its bytes and the bytes copied each way."""
        weights = host = None  # still loading (weights/pending.py)
        if self._pending is None:  # weights in host memory (runner/weight_offload.py) apart
            host = host_bytes(self.params)
            weights = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(self.params) if hasattr(x, "nbytes")) - host
        caches = jax.tree_util.tree_leaves(self.kv_cache)  # one array, or one per pool of a per-group cache
        devices = list(caches[0].sharding.device_set)
        out: dict[str, Any] = {"weights": weights, "kv_cache": sum(int(c.nbytes) for c in caches),
                               "platform": devices[0].platform, "device_kind": devices[0].device_kind,
                               "num_devices": len(devices), "limit": None, "in_use": None}
        if host:
            out["weights_host"] = host
        if self.kv_transfer is not None:  # the host tier: its pages' bytes, and the bytes copied each way so far
            t = self.kv_transfer
            out.update(kv_offload=int(t.storage.nbytes), kv_offload_to_host=t.bytes_to_host,
                       kv_offload_to_device=t.bytes_to_device)
        mems = [device_memory(d) for d in devices]
        if all(m is not None for m in mems):
            out["limit"] = sum(m.limit for m in mems)
            out["in_use"] = sum(m.in_use for m in mems)
        return out

    # ---- warm-up (runner/warmup.py) ----------------------------------------------------------------
    def warmup_plan(self) -> tuple[list[HostStep], dict[Any, tuple[int, str]]]:
        """The steps warm-up runs and the programs it compiles for them, in order (runner/warmup.py: `plan`)."""
        return warmup.plan(self)

    def warmup(self, progress: bool = True) -> int:
        """Compile every step program and run each step on padding (runner/warmup.py: `warm_up`); returns the
        number of programs compiled or loaded."""
        n = warmup.warm_up(self, progress)
        if self.kv_transfer is not None:  # the host tier's copy programs, every size class a step's copies can take
            t = time.perf_counter()
            self.kv_cache, classes = self.kv_transfer.warm(self.kv_cache, self.num_pages)
            log.info("warm-up: the KV host tier's copy programs at %d sizes in %.1f s", classes,
                     time.perf_counter() - t)
        self._warm = True
        self.reset_expert_load()  # warm-up's steps are padding, counted as none; start from zero all the same
        return n

    def padding_step(self, bucket: int, full: bool, masked: bool = False) -> HostStep:
        """A step of `bucket` with no sequences (all padding), in the full sampling variant, the mask one (`masked`)
        or the base one."""
        return self._host_step([[]] * self.num_ranks, {}, {}, bucket, full, masked=masked)

    def has_mask_variant(self) -> bool:
        """Whether steps whose constrained rows need only their bitmask (no logprobs, penalties, top-k / top-p,
        logit_bias) sample in the mask variant rather than the full one: where a step's forward may be a program of
        its own (StepPrograms.splits_full), the shapes have a bitmask and no speculation."""
        return self.programs.splits_full() and self.shapes.mask_words > 0 and self.shapes.spec_width == 1

    def has_greedy_variant(self, bucket: int) -> bool:
        """Whether `bucket` has the greedy sampling variant (RunnerConfig.greedy_variant: decode buckets)."""
        return self.runner_cfg.greedy_variant and bucket <= self.shapes.seq_rows(bucket)

    def state_signature(self) -> tuple:
        """The signature of the arguments every step program shares (params, KV cache, previous tokens)."""
        return program_cache.signature((self.params, self.kv_cache, self._prev_tokens))

    def lower(self, pid):
        """Trace and lower program `pid` (step_programs.program_kind) on this runner's state."""
        return self.programs.lower(pid, self.params, self.kv_cache, self._prev_tokens)

    def trace(self, pid):
        """Trace program `pid` on this runner's state (jax's Traced: `.jaxpr`, `.lower()`)."""
        return self.programs.trace(pid, self.params, self.kv_cache, self._prev_tokens)

    def await_params(self) -> None:
        """Take the params once loaded (weights/pending.py; a no-op when they were given loaded)."""
        if self._pending is not None:
            t = time.perf_counter()
            pending, self.params = self._pending, self._pending.result()
            self._pending = None
            waited = self.startup_seconds["weights_waited"] = time.perf_counter() - t
            self.startup_seconds["weights"] = pending.seconds
            log.info("warm-up: waited %.1f s for the weights", waited)

    # ---- host tier of the KV cache (runner/kv_transfer.py) -----------------------------------------
    def enable_host_tier(self, num_host_blocks: int) -> None:
        """Hold `num_host_blocks` pages in host memory for the scheduler's host tier."""
        if self.num_ranks > 1:
            raise ValueError("kv_offloading_size is not supported with data-parallel attention "
                             "(--data-parallel-size > 1)")
        self.kv_transfer = KVTransfer(self.kv_cache, num_host_blocks)

    def apply_kv_transfers(self, transfers) -> None:
        """Queue a plan's page copies (scheduler/host_tier.py KVTransfers) before its step; None: nothing. Their
        programs were compiled at warm-up (KVTransfer.warm); a compile here counts in `compiles_after_warmup`."""
        if transfers:
            before = CompileCounter.count()
            self.kv_cache = self.kv_transfer.apply(self.kv_cache, transfers)
            self._count_compiles(before, "a KV host-tier copy program (%d loads, %d saves)", len(transfers.loads),
                                 len(transfers.saves))

    def _count_compiles(self, before: int, what: str, *args) -> None:
        """After warm-up: add the compiles since CompileCounter read `before` to `compiles_after_warmup`, with a
        warning naming `what` (a %-format of `args`)."""
        n = CompileCounter.count() - before
        if self._warm and n:
            self.compiles_after_warmup += n
            log.warning("compiled " + what + " after warm-up", *args)

    # ---- execution -------------------------------------------------------------------------------
    def prepare(self, plan_seqs, requests, seeds, ranks=None, masks: bool = True) -> HostStep:
        """`ranks[i]`: the data-parallel rank of plan_seqs[i] (needed when num_ranks > 1). `masks` False leaves the
        structured-output rows' token bitmasks unfilled (all ones), for `run` to fill later."""
        if self.num_ranks == 1:
            groups = [plan_seqs]
        elif ranks is None:
            raise ValueError(f"a step over {self.num_ranks} data-parallel ranks needs each seq's rank")
        else:
            groups = [[s for s, r in zip(plan_seqs, ranks) if r == k] for k in range(self.num_ranks)]
        bucket = self.shapes.bucket_for(max(sum(len(s.token_ids) for s in g) for g in groups))
        lean = self.has_mask_variant()
        want_full = any(needs_full_variant(requests[s.request_id], lean) for s in plan_seqs)
        masked = lean and not want_full and any(requests[s.request_id].grammar is not None for s in plan_seqs)
        host = self._host_step(groups, requests, seeds, bucket, want_full, masks, masked)
        if not (want_full or masked) and self.has_greedy_variant(bucket) and all(
                requests[s.request_id].sampling_params.is_greedy() for s in plan_seqs):
            host.greedy = True
        return host

    def _host_step(self, groups, requests, seeds, bucket: int, full: bool, masks: bool = True,
                   masked: bool = False) -> HostStep:
        """One rank's seqs per group -> the padded HostStep (ranks laid out one after another). `masked`: the mask
        variant (one rank only: `has_mask_variant`)."""
        if self.num_ranks == 1:
            (seqs,) = groups
            meta = build_metadata(seqs, self.shapes, bucket, self._mark_context, self.page_rows)
            st = build_sampling(seqs, requests, seeds, self.shapes, bucket, full, masks=masks, masked=masked)
            rows = [i for i, s in enumerate(seqs) if s.sample]
            if self.shapes.mtp_drafts:
                meta = dataclasses.replace(meta, next_token_ids=spec_mtp.next_token_ids(
                    seqs, requests, self.shapes.seq_rows(bucket)))
            return HostStep(meta, st, [s.request_id for s in seqs], rows, bucket, full,
                            spec_width=self.shapes.spec_width, masked=masked)
        metas = [build_metadata(g, self.shapes, bucket, page_rows=self.page_rows) for g in groups]
        if self.shapes.mtp_drafts:
            metas = [dataclasses.replace(m, next_token_ids=spec_mtp.next_token_ids(g, requests, self.shapes.seq_rows(
                bucket))) for m, g in zip(metas, groups)]
        sts = [build_sampling(g, requests, seeds, self.shapes, bucket, full) for g in groups]
        meta, st, rids, rows = merge_rank_steps(metas, sts, groups, bucket, self.shapes.seq_rows(bucket))
        return HostStep(meta, st, rids, rows, bucket, full, spec_width=self.shapes.spec_width)

    def run(self, host: HostStep, before_sampling=None) -> StepOut:
        """Queue the step: one host->device copy of its packed inputs, the small program that puts them
        in the step program's inbox, the step program, and the small one that copies its results out. Where
        the step shares its bucket's forward (StepPrograms.shares_forward): two copies and two stagings (the
        forward's inputs, the sampler's), the forward, then the sampler. `before_sampling` (such a step only):
        (callback, plan_seqs, requests): once the forward is queued, the callback runs (the engine's fetch of the
        step before, which advances the structured-output matchers), then the rows' bitmasks are filled from the
        matchers, then the sampler is queued; the forward runs on the device meanwhile."""
        if self._pending is not None:  # the first step before warm-up (warm-up takes the params itself)
            self.await_params()
        if self.channel is not None:  # several hosts: the other ranks run this step too, in this order
            self.channel.send_step(host)
        progs = self.programs
        key, inputs = packed(host)
        res = progs.resident(key)
        if progs.shares_forward(key):  # the bucket's forward, then the variant's sampler
            ml, sid = key[0], progs.sampler_id(key)
            n, out_key = sum(sizes(ml)), progs.forward_buffers(ml)
            progs.forward_inboxes[ml] = self._stage(progs.forward_inboxes[ml], inputs[:n])
            fwd, smp = progs.program(("forward", ml)), progs.program(("sampler", sid))
            inbox, out = progs.forward_inboxes[ml], progs.forward_outputs[out_key]
            self.kv_cache, progs.forward_outputs[out_key] = fwd(self.params, self.kv_cache, self._prev_tokens, inbox, out)
            if before_sampling is not None:  # the forward is queued: now the masks, then the sampler's inputs
                callback, seqs, reqs = before_sampling
                callback()
                t = time.perf_counter()
                self.mask_fill_rows += fill_masks(seqs, reqs, host.sampling)
                self.last_mask_fill_seconds = time.perf_counter() - t
                self.mask_fill_seconds += self.last_mask_fill_seconds
                self.mask_fills += 1
                inputs = packed(host)[1]
            res.inbox = self._stage(res.inbox, inputs[n:])
            self._prev_tokens, res.outbox = smp(progs.forward_outputs[out_key], self._prev_tokens, res.inbox,
                                                res.outbox)
        else:
            step = progs.program(key)
            res.inbox = self._stage(res.inbox, inputs)
            self.kv_cache, self._prev_tokens, res.outbox = step(
                self.params, self.kv_cache, self._prev_tokens, res.inbox, res.outbox)
        if res.load_shape is None:
            buf, routing = self._extract(res.outbox, res.n_sampled, res.routing_shape)
        else:
            buf, routing, self._expert_load = self._extract(res.outbox, res.n_sampled, res.routing_shape,
                                                            res.load_shape, self._expert_load)
        out = StepOut(buf, res.sampled_layout, routing)
        self.last_routing = routing  # [num_moe_layers, T, k] when RunnerConfig.collect_routing
        return out

    # ---- expert load (RunnerConfig.count_expert_load) ------------------------------------------------
    def expert_load(self) -> np.ndarray | None:
        """The token copies routed to each logical expert of each MoE layer since warm-up (or the last
        `reset_expert_load`), int64 [num_moe_layers, E] on the host, up to the last step queued; None unless
        RunnerConfig.count_expert_load. Waits for that step; safe from another thread than the one stepping."""
        load = self._expert_load
        return None if load is None else np.asarray(load, np.int64)

    def reset_expert_load(self) -> None:
        """Zero the counts `expert_load` reads (RunnerConfig.count_expert_load; otherwise nothing to do)."""
        shape = self.programs.load_shape
        if shape is not None:
            self._expert_load = jax.device_put(np.zeros(shape, np.int32), self.programs.resident_sharding)

    def follow(self, channel) -> int:
        """Another rank than 0 of several hosts (runner/multihost.py): run each step rank 0 sends, in order, until
        it closes the channel; returns the number of steps run."""
        n = 0
        while (host := channel.recv_step()) is not None:
            self.run(host).block_until_ready()
            n += 1
        return n

    def defers_masks(self, plan_seqs, requests) -> bool:
        """Whether a step of these seqs runs its forward before its sampling inputs are built (`dispatch`'s
        `before_sampling`): full-variant steps where the programs split them (StepPrograms.splits_full), one
        sampling row a sequence."""
        return (self.programs.splits_full() and self.shapes.spec_width == 1
                and any(needs_full_variant(requests[s.request_id]) for s in plan_seqs))

    def dispatch(self, plan_seqs, requests, seeds, ranks=None, before_sampling=None) -> tuple[HostStep, Any]:
        """Queue one step on the device and return at once (JAX dispatch is asynchronous).

        Token ids <= -2 in the plan (and in the penalty histories) are placeholders for ids the
        previous dispatched step samples: -(row + 2) reads row `row` of its output on the device, so
        the host can plan step N+1 before step N's ids come back. `fetch` waits for the results.

        `before_sampling`: a callable the step's structured-output bitmasks depend on (the engine's fetch of the
        step in flight, which advances the matchers). Where the step's forward is a program of its own
        (`defers_masks`) it runs once the forward is queued, so the device computes the forward meanwhile;
        otherwise first."""
        later = None
        if before_sampling is not None:
            if self.defers_masks(plan_seqs, requests):
                later = (plan_seqs, requests)
            else:
                before_sampling()
        host = self.prepare(plan_seqs, requests, seeds, ranks, masks=later is None)
        self.last_num_tokens = sum(len(s.token_ids) for s in plan_seqs)
        self.steps_by_variant[host.variant] += 1
        before = CompileCounter.count()
        out = self.run(host) if later is None else self.run(host, before_sampling=(before_sampling, *later))
        # Start the results' device-to-host copy now: it runs as soon as the step ends, and `fetch`
        # (called after the next step is queued) finds them on the host.
        out.copy_to_host_async()
        self._count_compiles(before, "a new step shape (bucket %d, %s)", host.bucket, host.variant)
        return host, out

    def score_prompt(self, token_ids: list[int]):
        """Prompt logprobs (runner/prompt_scoring.py): (logprob [L-1], rank [L-1], top ids [L-1, k], top logprobs
        [L-1, k]) with k = max_logprobs. Runs after the steps already queued and waits for its result."""
        if self.num_ranks > 1:
            raise ValueError("prompt_logprobs is not supported with data-parallel attention "
                             "(--data-parallel-size > 1)")
        if self._pending is not None:
            self.await_params()
        if self._scorer is None:
            self._scorer = PromptScorer(self.cfg, self.max_logprobs, self.runner_cfg.moe_impl)
        return self._scorer.score(self.params, token_ids)

    def fetch(self, inflight: tuple[HostStep, Any]) -> StepResult:
        """A dispatched step's results on the host (waits for the device); its seconds add to `fetch_seconds`."""
        t = time.perf_counter()
        try:
            return self.collect(*inflight)
        finally:
            self.fetch_seconds += time.perf_counter() - t

    def execute(self, plan_seqs, requests, seeds, ranks=None) -> StepResult:
        return self.fetch(self.dispatch(plan_seqs, requests, seeds, ranks))

    def collect(self, host: HostStep, out: "StepOut") -> StepResult:
        return step_result(host, out.to_host())
