"""The device side of a step: params and the paged KV cache, one jitted program per step.

`ModelRunner.execute(plan, requests, seeds)` pads the plan (runner/inputs.py) and queues one program:
the forward of the step's token bucket (the KV cache donated and updated in place) and the sampler,
which reads the logits of each sequence's last token on the device (logits never leave it). It returns
the sampled token ids (and logprobs) for the rows that sample.

Variants: for each token bucket, a base sampler (no penalties, no top-k / top-p, no top logprobs) and
a full one (penalty history arrays, the top-k / top-p sort, top `max_logprobs` logprobs), and for decode
buckets (RunnerConfig.greedy_variant) a greedy one (every row greedy: no draw); the host picks one per step
(inputs.needs_full_variant, `prepare`), so the step has no device-side branch. A bucket's programs share
the forward's trace; with RunnerConfig.prefill_shared_forward a prefill bucket's variants share its compiled
forward too, each step then the forward and the variant's sampler as two programs (`_shares_forward`).
`warmup()` compiles all of them (runner/warmup.py); afterwards `CompileCounter` sees every backend compile (or
persistent-cache load) during this runner's steps, and `compiles_after_warmup` must stay 0 (tests assert it;
production logs a warning).

`params` may still be loading (a weights.pending.PendingParams): on one device the runner then holds their abstract
tree, from which warm-up lowers and compiles every program, and takes the arrays before the first step runs
(`_await_params`).

Sharded (`sharding`, a deepinfer_jax.sharding.ModelSharding): the params and the KV cache are placed on
their shardings, the step's inputs are constrained to theirs inside the jit (token arrays and rows over
the data axis) and the model gets the mesh rules. With data-parallel attention (`sharding.num_ranks`
> 1) `num_pages` is per rank, the cache holds num_ranks x num_pages pages, and a step lays the ranks'
shares out rank after rank (sharding/data_parallel.py); `execute` then needs each seq's rank.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig, RunnerConfig
from deepinfer_jax.models.cache import init_kv_cache, kv_cache_shape
from deepinfer_jax.models.deepseek import forward_paged, splits_prefill_attention
from deepinfer_jax.runner.compile_cache import CompileCounter
from deepinfer_jax.runner.lowering import speed_up_kernel_lowering
from deepinfer_jax.runner.inputs import (HostStep, PageRows, Shapes, build_metadata, build_sampling, needs_full_variant,
                                         next_pow2)
from deepinfer_jax.runner.packing import Layout, bits_layout, bits_size, pack_bits, sizes, unpack
from deepinfer_jax.runner.step_io import (Resident, StepOut, StepResult, extract_results, meta_struct, packed,
                                          resolve_placeholders, split_inbox, step_result)
from deepinfer_jax.sampling import sample
from deepinfer_jax.sharding.data_parallel import merge_rank_steps
from deepinfer_jax.weights.pending import PendingParams

log = logging.getLogger(__name__)


def _program_kind(pid) -> tuple[str, Any]:
    """A program id -> ("step", the step's key), or ("forward", meta layout) / ("sampler", sampler id) where steps
    share their bucket's forward (ModelRunner._shares_forward, ModelRunner._sampler_id)."""
    return pid if isinstance(pid[0], str) else ("step", pid)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: Any, runner_cfg: RunnerConfig, shapes: Shapes,
                 num_pages: int, max_logprobs: int = 20, sharding: Any = None):
        CompileCounter.install()
        speed_up_kernel_lowering()  # runner/lowering.py: less of warm-up's lowering on one thread
        # Params still loading (weights/pending.py): on one device warm-up lowers and compiles from their abstract
        # tree and takes the arrays before its runs (`_await_params`); sharded, they are needed here.
        self._pending = None
        if isinstance(params, PendingParams):
            if sharding is None:
                self._pending, params = params, params.abstract
            else:
                params = params.result()
        self.cfg, self.params, self.runner_cfg, self.shapes = cfg, params, runner_cfg, shapes
        self.num_pages = num_pages
        self.max_logprobs = max_logprobs
        self.kv_dtype = jnp.dtype(runner_cfg.dtype)
        self.sharding = sharding
        self.num_ranks = 1 if sharding is None else sharding.num_ranks
        # Prefill-bucket steps carry StepMetadata.has_context from the host (inputs.build_metadata) where their
        # program takes the split attention, whose context part it names (one device, the Pallas path).
        self._mark_context = runner_cfg.prefill_context_variant and sharding is None and splits_prefill_attention(
            cfg, runner_cfg.attn_impl, None, runner_cfg.prefill_attention)
        self.page_rows = PageRows()  # the running requests' page ids, converted once (`forget` drops one)
        if sharding is not None:  # a no-op for params already loaded onto their shardings
            self.params = jax.device_put(params, sharding.fit_param_shardings(cfg, params))
            shape = kv_cache_shape(cfg, num_pages * self.num_ranks, shapes.page_size)
            self.kv_cache = jnp.zeros(shape, self.kv_dtype, device=sharding.kv_cache)
        else:
            self.kv_cache = init_kv_cache(cfg, num_pages, shapes.page_size, self.kv_dtype)
        self._fwd_fns: dict[Any, Any] = {}  # meta layout (one per bucket) -> jitted forward
        self._smp_fns: dict[Any, Any] = {}  # (variant, sampling layout) -> jitted sampler
        self._core_fns: dict[Any, Any] = {}  # (meta layout, variant, sampling layout) -> jitted step core
        self._step_fns: dict[Any, Any] = {}  # the same keys -> jitted step program (resident buffers)
        self._step_exes: dict[Any, Any] = {}  # the same keys -> compiled executables (from warmup)
        self._programs: dict[Any, Resident] = {}  # the same keys (samplers: their pids) -> resident buffers
        # RunnerConfig.prefill_shared_forward (`_shares_forward`): a prefill bucket's forward and its variants'
        # samplers are programs of their own, under ("forward", meta layout) and ("sampler", sampler id) in
        # _step_fns, _step_exes and (the sampler's inbox and outbox) _programs. The forward's resident buffers: its
        # inbox int32 [meta ints + meta floats] a meta layout, and its output (logits [S, V] fp32) one a shape, rewritten in place by the forward and read by the sampler.
        self._shares: dict[Any, bool] = {}
        self._fwd_inboxes: dict[Any, Any] = {}
        self._fwd_outs: dict[jax.ShapeDtypeStruct, Any] = {}
        self._fwd_out_keys: dict[Any, jax.ShapeDtypeStruct] = {}  # a meta layout -> its output's key
        self._sampler_ids: dict[Any, tuple] = {}  # a step's key -> `_sampler_id`, cached for the host's path
        # Buffers the step programs read and write at fixed addresses (see _step_fn): replicated.
        self._resident_sharding = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if sharding is None
                                   else jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))
        # The previous step's sampled ids stay on the device: the next step's placeholders read them.
        self.max_rows = self.num_ranks * next_pow2(shapes.max_num_seqs)
        self._prev_tokens = jax.device_put(jnp.zeros((self.max_rows,), jnp.int32), self._resident_sharding)
        if sharding is None:
            # uncommitted, the first cache made the first real step compile again
            self.kv_cache = jax.device_put(self.kv_cache, jax.devices()[0])
        self._stage = jax.jit(lambda inbox, host: jax.lax.dynamic_update_slice(inbox, host, (0,)),
                              donate_argnums=0, out_shardings=self._resident_sharding)
        self._extract = jax.jit(extract_results, static_argnums=(1, 2))
        self._warm = False
        self.last_routing = None
        self.last_num_tokens = 0
        self.compiles_after_warmup = 0  # compilations seen while this runner executed steps after warm-up
        self.programs_loaded = 0  # step programs warm-up loaded from RunnerConfig.program_cache_dir

    # ---- compiled step ----------------------------------------------------------------------------
    def _forward_fn(self, layout: Layout):
        """The jitted forward of one bucket: (params, kv_cache, prev_tokens, ints, floats) ->
        ((logits [S, V] fp32, routing), kv_cache). Traced inside `_step_fn`'s program (its jaxpr is
        cached, so a bucket's variants share one trace); not run on its own."""
        if layout not in self._fwd_fns:
            cfg, rc, sh = self.cfg, self.runner_cfg, self.sharding

            def forward(params, kv_cache, prev_tokens, ints, floats):
                meta = resolve_placeholders(unpack(ints, floats, layout), None, prev_tokens)[0]
                if sh is not None:  # the packed inputs arrive replicated; each device keeps its rows
                    meta = jax.lax.with_sharding_constraint(meta, sh.step_shardings(meta, None)[0])
                unroll = rc.layer_loop(meta.token_ids.shape[0], jax.default_backend())
                out = forward_paged(params, cfg, kv_cache, meta, moe_impl=rc.moe_impl, attn_impl=rc.attn_impl,
                                    return_routing=rc.collect_routing, unroll=unroll,
                                    mesh_rules=None if sh is None else sh.mesh_rules, **rc.forward_switches())
                last, kv_cache = out[0], out[1]  # the logits
                if sh is not None:
                    last = jax.lax.with_sharding_constraint(last, sh.logits)
                    kv_cache = jax.lax.with_sharding_constraint(kv_cache, sh.kv_cache)
                return (last, out[2] if rc.collect_routing else None), kv_cache

            self._fwd_fns[layout] = jax.jit(forward)  # the step program donates the cache
        return self._fwd_fns[layout]

    def _sample_fn(self, variant: str, layout: Layout):
        """The jitted sampler of one (bucket, variant): (the forward's output, prev_tokens, ints, floats)
        -> (SampledTokens, the next step's prev_tokens [max_rows]). Traced inside `_step_fn`'s program."""
        key = (variant, layout)
        if key not in self._smp_fns:
            full, draw = variant == "full", variant != "greedy"
            k, sh, rows = self.max_logprobs if full else 0, self.sharding, self.max_rows

            def sample_step(out, prev_tokens, ints, floats):
                st = resolve_placeholders(None, unpack(ints, floats, layout), prev_tokens)[1]
                if sh is not None:
                    st = jax.lax.with_sharding_constraint(st, sh.step_shardings(None, st)[1])
                sampled = sample(out, st, max_logprobs=k, full=full, draw=draw)
                nxt = jnp.zeros((rows,), jnp.int32).at[: sampled.token_ids.shape[0]].set(sampled.token_ids)
                if sh is not None:
                    nxt = jax.lax.with_sharding_constraint(
                        nxt, jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec()))
                return sampled, nxt

            self._smp_fns[key] = jax.jit(sample_step)
        return self._smp_fns[key]

    def _core_fn(self, key):
        """The jitted step of one (bucket, variant) on unpacked inputs: (params, kv_cache, prev_tokens,
        meta ints, meta floats, sampling ints, sampling floats) -> ((SampleOutput, routing), next
        prev_tokens, kv_cache). The forward's and the sampler's traces are cached per bucket and per
        variant, so tracing the variants of a bucket traces its forward once."""
        if key not in self._core_fns:
            meta_layout, variant, sampling_layout = key
            fwd, smp = self._forward_fn(meta_layout), self._sample_fn(variant, sampling_layout)

            def core(params, kv_cache, prev_tokens, mi, mf, si, sf):
                (out, routing), kv_cache = fwd(params, kv_cache, prev_tokens, mi, mf)
                sampled, nxt = smp(out, prev_tokens, si, sf)
                return (sampled, routing), nxt, kv_cache

            self._core_fns[key] = jax.jit(core)
        return self._core_fns[key]

    def _resident(self, key) -> "Resident":
        """The resident inbox and outbox of one step program (made on first use), sized from the key's
        layouts: the sampler's result shapes (jax.eval_shape of the sampler alone, on the forward's output)
        and, with RunnerConfig.collect_routing, the routed ids [num_moe_layers, T, k]. Where the step shares its
        bucket's forward, its sampler's (`_sampler_resident`, shared with the steps of the same `_sampler_id`)."""
        if self._shares_forward(key):
            return self._sampler_resident(self._sampler_id(key))
        if key not in self._programs:
            meta_layout, variant, sampling_layout = key
            parts = (*sizes(meta_layout), *sizes(sampling_layout))  # mi, mf, si, sf
            meta = meta_struct(meta_layout)
            routing = None
            if self.runner_cfg.collect_routing:
                n_moe = sum(map(self.cfg.is_moe_layer, range(self.cfg.num_hidden_layers)))
                routing = (n_moe, meta.token_ids.shape[0], self.cfg.num_experts_per_tok)
            self._programs[key] = self._new_resident(parts, self._forward_out(meta_layout), variant, sampling_layout,
                                                     routing)
        return self._programs[key]

    def _sampler_resident(self, sid) -> "Resident":
        """The resident inbox (the sampling ints and floats alone: parts (0, 0, si, sf)) and outbox of the sampler
        program `sid` (`_sampler_id`), made on first use."""
        pid = ("sampler", sid)
        if pid not in self._programs:
            out, variant, sampling_layout = sid
            self._programs[pid] = self._new_resident((0, 0, *sizes(sampling_layout)), out, variant, sampling_layout,
                                                     None)
        return self._programs[pid]

    def _new_resident(self, parts, out: jax.ShapeDtypeStruct, variant: str, sampling_layout: Layout,
                      routing) -> "Resident":
        """Zeroed resident buffers: an inbox int32 [sum(parts)] and an outbox for the sampled tokens of `variant`
        on the forward's output `out` (jax.eval_shape of the sampler) and the routed ids `routing` (or None)."""
        ints_floats = (jax.ShapeDtypeStruct((n,), dt) for n, dt in zip(parts[2:], (jnp.int32, jnp.float32)))
        sampled, _ = jax.eval_shape(self._sample_fn(variant, sampling_layout), out, self._prev_tokens, *ints_floats)
        layout = bits_layout(sampled)
        size = bits_size(layout) + (math.prod(routing) if routing else 0)
        return Resident(parts, self._zeros((sum(parts),), jnp.int32), self._zeros((size,), jnp.int32), layout, routing)

    def _zeros(self, shape, dtype):
        """A resident buffer of zeros (see _step_fn), copied from the host: jnp.zeros would compile a program a
        shape on warm-up's lowering thread (23 of them, ~1 s, at serve's flags on an H200)."""
        return jax.device_put(np.zeros(shape, dtype), self._resident_sharding)

    def _forward_out(self, meta_layout: Layout) -> jax.ShapeDtypeStruct:
        """The forward's per-sequence output of one bucket: logits [S, V] fp32."""
        rows = meta_struct(meta_layout).logits_indices.shape[0]
        return jax.ShapeDtypeStruct((rows, self.cfg.vocab_size), jnp.float32)

    def _shares_forward(self, key) -> bool:
        """Whether `key`'s step runs as two programs (RunnerConfig.prefill_shared_forward): its bucket's forward,
        shared by the bucket's sampling variants, then the variant's sampler. Prefill buckets (more token slots
        than sequence rows) on one device, with no routing collected."""
        if key not in self._shares:
            rc, meta = self.runner_cfg, meta_struct(key[0])
            self._shares[key] = (rc.prefill_shared_forward and self.sharding is None and not rc.collect_routing
                                 and meta.token_ids.shape[0] > meta.logits_indices.shape[0])
        return self._shares[key]

    def _forward_buffers(self, meta_layout: Layout) -> jax.ShapeDtypeStruct:
        """Makes the resident inbox and output of the shared forward of `meta_layout`'s bucket on first use;
        returns the output's key in `_fwd_outs`."""
        if meta_layout not in self._fwd_inboxes:
            self._fwd_inboxes[meta_layout] = self._zeros((sum(sizes(meta_layout)),), jnp.int32)
            self._fwd_out_keys[meta_layout] = self._forward_output(self._forward_out(meta_layout))
        return self._fwd_out_keys[meta_layout]

    def _forward_output(self, out: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        """Makes the resident output buffer of shape `out` the shared forwards write on first use; returns `out`."""
        if out not in self._fwd_outs:
            self._fwd_outs[out] = self._zeros(out.shape, out.dtype)
        return out

    def _sampler_id(self, key) -> tuple:
        """The sampler program of a step that shares its bucket's forward: (the forward's output, variant, sampling
        layout). A prefill bucket's context variants (their meta layouts differ) share it, and its buffers."""
        if key not in self._sampler_ids:
            self._sampler_ids[key] = (self._forward_out(key[0]), key[1], key[2])
        return self._sampler_ids[key]

    def _forward_step_fn(self, meta_layout: Layout):
        """The jitted shared forward of a prefill bucket (`_shares_forward`): (params, kv_cache, prev_tokens,
        inbox, out) -> (kv_cache, out), the cache and `out` donated: the per-sequence output written over `out`
        in place (one address from step to step, as _step_fn's buffers)."""
        pid = ("forward", meta_layout)
        if pid not in self._step_fns:
            fwd, parts = self._forward_fn(meta_layout), sizes(meta_layout)

            def forward_step(params, kv_cache, prev_tokens, inbox, out):
                mi, mf = split_inbox(inbox, parts)
                (last, _), kv_cache = fwd(params, kv_cache, prev_tokens, mi, mf)
                return kv_cache, jax.lax.dynamic_update_slice(out, last.astype(out.dtype), (0, 0))

            self._step_fns[pid] = jax.jit(forward_step, donate_argnums=(1, 4))
        return self._step_fns[pid]

    def _sampler_step_fn(self, sid):
        """The jitted sampler program `sid` (`_sampler_id`) of a (prefill bucket, variant) (`_shares_forward`):
        (the shared forward's output, prev_tokens, inbox, outbox) -> (next prev_tokens, outbox),
        prev_tokens and the outbox donated; the outbox as _step_fn's (no routing)."""
        pid = ("sampler", sid)
        if pid not in self._step_fns:
            smp, res = self._sample_fn(sid[1], sid[2]), self._sampler_resident(sid)

            def sampler_step(out, prev_tokens, inbox, outbox):
                si, sf = split_inbox(inbox, res.parts[2:])
                sampled, nxt = smp(out, prev_tokens, si, sf)
                return nxt, jax.lax.dynamic_update_slice(outbox, pack_bits((sampled, None)), (0,))

            # keep_unused: a variant that reads no placeholder leaves prev_tokens unused, and jit would drop it and
            # its donation, so the next ids would land at a new address (and the next decode step's CUDA graph be
            # recorded again)
            self._step_fns[pid] = jax.jit(sampler_step, donate_argnums=(1, 3), keep_unused=True)
        return self._step_fns[pid]

    def _step_fn(self, key):
        """The jitted step program of one (bucket, variant): (params, kv_cache, prev_tokens, inbox,
        outbox) -> (kv_cache, next prev_tokens, outbox), the cache, prev_tokens and outbox donated.

        Every buffer its CUDA graph touches keeps one address from step to step, so XLA replays the
        graph as recorded. The step's host inputs arrive in a fresh buffer that a small program
        (`_stage`) copies into this program's resident inbox; the results (packed, pack_bits) overwrite
        its resident outbox, which another small program (`extract_results`) copies out for the
        host. Fed fresh buffers instead, XLA's VA remapping left 8 of the graph's allocations out and
        re-recorded the ~700-command graph at every step of the engine: ~1 ms of host time and the
        graph's upload on the device (benchmarks/RESULTS.md, session 6). For the same reason the
        forward and the sampler are one program: as two, the forward's graph was re-recorded at every
        step (1.6 ms; session 5), its output then a fresh buffer each step. (RunnerConfig.prefill_shared_forward's
        two programs keep every buffer resident: `_forward_step_fn`.)"""
        if key not in self._step_fns:
            core, res = self._core_fn(key), self._resident(key)
            # no `self` in the closure: the runner (and its KV cache) must go when its owner drops it
            resident_sharding = self._resident_sharding if self.sharding is not None else None

            def step(params, kv_cache, prev_tokens, inbox, outbox):
                mi, mf, si, sf = split_inbox(inbox, res.parts)
                results, nxt, kv_cache = core(params, kv_cache, prev_tokens, mi, mf, si, sf)
                sampled, routing = results
                if (bits_layout(sampled) != res.sampled_layout or
                        (None if routing is None else routing.shape) != res.routing_shape):
                    raise AssertionError(f"step results {results} do not fit the outbox made for them")
                outbox = jax.lax.dynamic_update_slice(outbox, pack_bits(results), (0,))  # in place
                if resident_sharding is not None:
                    outbox = jax.lax.with_sharding_constraint(outbox, resident_sharding)
                return kv_cache, nxt, outbox

            self._step_fns[key] = jax.jit(step, donate_argnums=(1, 2, 4))
        return self._step_fns[key]

    def _program_key(self, pid, state_signature: tuple) -> str:
        """The program cache's key of one program (runner/program_cache.py; `pid`: a step's key, or ("forward",
        meta layout) / ("sampler", key) where steps share their bucket's forward): the configurations, shapes,
        the program's layouts (which fix its inbox and outbox) and `state_signature`, the signature of the
        arguments every step program shares (params, KV cache, previous tokens); the cache adds the code and
        the device."""
        from deepinfer_jax.runner import program_cache

        rc = dataclasses.replace(self.runner_cfg, program_cache_dir=None)
        kind, key = _program_kind(pid)
        if kind == "forward":
            layouts = (key, sizes(key), self._forward_out(key))
        else:
            res = self._sampler_resident(key) if kind == "sampler" else self._resident(key)
            layouts = (key, res.parts, res.sampled_layout, res.routing_shape)
        return program_cache.program_key(kind, self.cfg, rc, self.shapes, self.num_pages, self.max_logprobs,
                                         *layouts, state_signature)

    def _lower(self, pid):
        """Trace and lower one program (`_program_key`'s `pid`) on the runner's resident buffers."""
        kind, key = _program_kind(pid)
        if kind == "forward":
            out = self._forward_buffers(key)
            return self._forward_step_fn(key).lower(self.params, self.kv_cache, self._prev_tokens,
                                                    self._fwd_inboxes[key], self._fwd_outs[out])
        if kind == "sampler":
            res, out = self._sampler_resident(key), self._fwd_outs[self._forward_output(key[0])]
            return self._sampler_step_fn(key).lower(out, self._prev_tokens, res.inbox, res.outbox)
        res = self._resident(key)
        return self._step_fn(key).lower(self.params, self.kv_cache, self._prev_tokens, res.inbox, res.outbox)

    def _host_programs(self, key) -> tuple:
        """The program ids (`_program_key`'s `pid`) a step of `key` runs: its step program, or where it shares its
        bucket's forward (RunnerConfig.prefill_shared_forward) that forward and the variant's sampler."""
        return (("forward", key[0]), ("sampler", self._sampler_id(key))) if self._shares_forward(key) else (key,)

    def warmup_plan(self) -> tuple[list[HostStep], dict[Any, tuple[int, str]]]:
        """The steps warm-up runs and the programs it compiles for them, in order (runner/warmup.py: `plan`)."""
        from deepinfer_jax.runner import warmup

        return warmup.plan(self)

    def warmup(self, progress: bool = True) -> int:
        """Compile every step program and run each step on padding (runner/warmup.py: `warm_up`); returns the
        number of programs compiled or loaded."""
        from deepinfer_jax.runner import warmup

        n = warmup.warm_up(self, progress)
        self._warm = True
        return n

    def _await_params(self) -> None:
        """Take the params once loaded (weights/pending.py; a no-op when they were given loaded)."""
        if self._pending is not None:
            t = time.perf_counter()
            self.params, self._pending = self._pending.result(), None
            log.info("warm-up: waited %.1f s for the weights", time.perf_counter() - t)

    # ---- execution -------------------------------------------------------------------------------
    def prepare(self, plan_seqs, requests, seeds, ranks=None) -> HostStep:
        """`ranks[i]`: the data-parallel rank of plan_seqs[i] (needed when num_ranks > 1)."""
        if self.num_ranks == 1:
            groups = [plan_seqs]
        elif ranks is None:
            raise ValueError(f"a step over {self.num_ranks} data-parallel ranks needs each seq's rank")
        else:
            groups = [[s for s, r in zip(plan_seqs, ranks) if r == k] for k in range(self.num_ranks)]
        bucket = self.shapes.bucket_for(max(sum(len(s.token_ids) for s in g) for g in groups))
        want_full = any(needs_full_variant(requests[s.request_id]) for s in plan_seqs)
        host = self._host_step(groups, requests, seeds, bucket, want_full)
        if not want_full and self._greedy_bucket(bucket) and all(
                requests[s.request_id].sampling_params.is_greedy() for s in plan_seqs):
            host.greedy = True
        return host

    def _greedy_bucket(self, bucket: int) -> bool:
        """Whether `bucket` has the greedy sampling variant (RunnerConfig.greedy_variant: decode buckets)."""
        return self.runner_cfg.greedy_variant and bucket <= self.shapes.seq_rows(bucket)

    def _host_step(self, groups, requests, seeds, bucket: int, full: bool) -> HostStep:
        """One rank's seqs per group -> the padded HostStep (ranks laid out one after another)."""
        if self.num_ranks == 1:
            (seqs,) = groups
            meta = build_metadata(seqs, self.shapes, bucket, self._mark_context, self.page_rows)
            st = build_sampling(seqs, requests, seeds, self.shapes, bucket, full)
            rows = [i for i, s in enumerate(seqs) if s.sample]
            return HostStep(meta, st, [s.request_id for s in seqs], rows, bucket, full)
        metas = [build_metadata(g, self.shapes, bucket, page_rows=self.page_rows) for g in groups]
        sts = [build_sampling(g, requests, seeds, self.shapes, bucket, full) for g in groups]
        meta, st, rids, rows = merge_rank_steps(metas, sts, groups, bucket, self.shapes.seq_rows(bucket))
        return HostStep(meta, st, rids, rows, bucket, full)

    def _run(self, host: HostStep) -> "StepOut":
        """Queue the step: one host->device copy of its packed inputs, the small program that puts them
        in the step program's inbox, the step program, and the small one that copies its results out. Where
        the step shares its bucket's forward (`_shares_forward`): two copies and two stagings (the forward's
        inputs, the sampler's), the forward, then the sampler."""
        if self._pending is not None:  # the first step before warm-up (warm-up takes the params itself)
            self._await_params()
        key, inputs = packed(host)
        res = self._resident(key)
        if self._shares_forward(key):  # the bucket's forward, then the variant's sampler
            ml, sid = key[0], self._sampler_id(key)
            n, out_key = sum(sizes(ml)), self._forward_buffers(ml)
            self._fwd_inboxes[ml] = self._stage(self._fwd_inboxes[ml], inputs[:n])
            res.inbox = self._stage(res.inbox, inputs[n:])
            fwd = self._step_exes.get(("forward", ml)) or self._forward_step_fn(ml)
            smp = self._step_exes.get(("sampler", sid)) or self._sampler_step_fn(sid)
            self.kv_cache, self._fwd_outs[out_key] = fwd(self.params, self.kv_cache, self._prev_tokens,
                                                         self._fwd_inboxes[ml], self._fwd_outs[out_key])
            self._prev_tokens, res.outbox = smp(self._fwd_outs[out_key], self._prev_tokens, res.inbox, res.outbox)
        else:
            step = self._step_exes.get(key) or self._step_fn(key)
            res.inbox = self._stage(res.inbox, inputs)
            self.kv_cache, self._prev_tokens, res.outbox = step(
                self.params, self.kv_cache, self._prev_tokens, res.inbox, res.outbox)
        buf, routing = self._extract(res.outbox, res.n_sampled, res.routing_shape)
        out = StepOut(buf, res.sampled_layout, routing)
        self.last_routing = routing  # [num_moe_layers, T, k] when RunnerConfig.collect_routing
        return out

    def dispatch(self, plan_seqs, requests, seeds, ranks=None) -> tuple[HostStep, Any]:
        """Queue one step on the device and return at once (JAX dispatch is asynchronous).

        Token ids <= -2 in the plan (and in the penalty histories) are placeholders for ids the
        previous dispatched step samples: -(row + 2) reads row `row` of its output on the device, so
        the host can plan step N+1 before step N's ids come back. `fetch` waits for the results."""
        host = self.prepare(plan_seqs, requests, seeds, ranks)
        self.last_num_tokens = sum(len(s.token_ids) for s in plan_seqs)
        before = CompileCounter.count()
        out = self._run(host)
        # Start the results' device-to-host copy now: it runs as soon as the step ends, and `fetch`
        # (called after the next step is queued) finds them on the host.
        out.copy_to_host_async()
        if self._warm and CompileCounter.count() != before:
            self.compiles_after_warmup += CompileCounter.count() - before
            log.warning("compiled a new step shape after warm-up (bucket %d, %s)", host.bucket, host.variant)
        return host, out

    def fetch(self, inflight: tuple[HostStep, Any]) -> StepResult:
        return self.collect(*inflight)

    def execute(self, plan_seqs, requests, seeds, ranks=None) -> StepResult:
        return self.fetch(self.dispatch(plan_seqs, requests, seeds, ranks))

    def collect(self, host: HostStep, out: "StepOut") -> StepResult:
        return step_result(host, out.to_host())
