"""The jitted step programs of one runner, their resident buffers and their compiled executables.

A step program is keyed by its step's key (meta layout, sampling variant, sampling layout: step_io.packed). It
runs the bucket's forward and the variant's sampler on buffers that keep one address from step to step
(`Resident`), so that XLA replays its CUDA graph as recorded. With RunnerConfig.prefill_shared_forward a prefill
bucket's step is two programs instead (`shares_forward`): the bucket's forward, shared by its sampling variants
and its context variants, under ("forward", meta layout), and the variant's sampler under ("sampler",
`sampler_id`). `program_kind` tells the three kinds of program id apart.

`StepPrograms` makes each program on first use (`program`), lowers it on the runner's state for warm-up
(`lower`), names it in the program cache (`program_key`) and holds the executables warm-up compiled or loaded
(`executables`). It holds no params and no KV cache: the runner passes them to each call.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig, RunnerConfig
from deepinfer_jax.models.mtp import mtp_propose
from deepinfer_jax.models.v4_mtp import v4_mtp_propose
from deepinfer_jax.models.registry import family_of
from deepinfer_jax.runner import program_cache, spec_overlap
from deepinfer_jax.runner.inputs import Shapes
from deepinfer_jax.runner.packing import Layout, bits_layout, bits_size, pack_bits, sizes, unpack
from deepinfer_jax.runner.step_io import Resident, meta_struct, resolve_placeholders, split_inbox
from deepinfer_jax.runner.weight_offload import stream, to_device
from deepinfer_jax.sampling import sample


def program_kind(pid) -> tuple[str, Any]:
    """A program id -> ("step", the step's key), or ("forward", meta layout) / ("sampler", sampler id) where steps
    share their bucket's forward (`StepPrograms.shares_forward`, `StepPrograms.sampler_id`)."""
    return pid if isinstance(pid[0], str) else ("step", pid)


class StepPrograms:
    def __init__(self, cfg: ModelConfig, runner_cfg: RunnerConfig, shapes: Shapes, num_pages: int,
                 max_logprobs: int, sharding: Any, max_rows: int):
        self.cfg, self.runner_cfg, self.shapes, self.sharding = cfg, runner_cfg, shapes, sharding
        self.num_pages, self.max_logprobs, self.max_rows = num_pages, max_logprobs, max_rows
        # Buffers the step programs read and write at fixed addresses (see _step_fn): replicated.
        self.resident_sharding = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if sharding is None
                                  else jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))
        # The previous step's sampled ids, which every program reads (the runner holds the array).
        # With RunnerConfig.spec_overlap, that of the overlapped speculating loop (runner/spec_overlap.py).
        self.overlap = runner_cfg.spec_overlap and shapes.mtp_drafts > 0
        prev = spec_overlap.prev_size(max_rows, shapes.mtp_drafts) if self.overlap else max_rows
        self.prev_tokens = jax.ShapeDtypeStruct((prev,), jnp.int32, sharding=self.resident_sharding)
        self.forward_fns: dict[Any, Any] = {}  # meta layout (one per bucket) -> jitted forward
        self._smp_fns: dict[Any, Any] = {}  # (variant, sampling layout) -> jitted sampler
        self._core_fns: dict[Any, Any] = {}  # a step's key -> jitted step core
        self.jitted: dict[Any, Any] = {}  # program id -> jitted program (on resident buffers)
        self.executables: dict[Any, Any] = {}  # program id -> compiled executable (from warm-up)
        self.residents: dict[Any, Resident] = {}  # a step's key, or a sampler's program id -> resident buffers
        # The shared forwards' resident buffers: an inbox int32 [meta ints + meta floats] a meta layout, and an
        # output (logits [S, V] fp32) a shape, rewritten in place by the forward and read by the sampler.
        self.forward_inboxes: dict[Any, Any] = {}
        self.forward_outputs: dict[jax.ShapeDtypeStruct, Any] = {}
        self._fwd_out_keys: dict[Any, jax.ShapeDtypeStruct] = {}  # a meta layout -> its output's key
        self._shares: dict[Any, bool] = {}
        self._sampler_ids: dict[Any, tuple] = {}  # a step's key -> `sampler_id`, cached for the host's path

    # ---- what a step runs ---------------------------------------------------------------------------
    def splits_full(self) -> bool:
        """Whether steps may run as two programs (`shares_forward`): RunnerConfig.prefill_shared_forward, on one
        device, with no routing collected or counted, and no MTP drafting (which needs the forward's hidden states
        and the sampler's tokens in one program)."""
        rc = self.runner_cfg
        return (rc.prefill_shared_forward and self.sharding is None and not rc.collect_routing
                and not rc.count_expert_load and not self.shapes.mtp_drafts)

    def shares_forward(self, key) -> bool:
        """Whether `key`'s step runs as two programs (`splits_full`): its bucket's forward, shared by the bucket's
        sampling variants, then the variant's sampler. Prefill buckets (more token slots than sequence rows), whose
        variants then share one compiled forward, and every bucket's full and mask variants, whose structured-output
        bitmasks can then be filled on the host while the forward runs (ModelRunner.dispatch); with
        RunnerConfig.decode_shared_forward every variant of every bucket, so a decode bucket's forward is compiled
        once for its variants."""
        if key not in self._shares:
            meta = meta_struct(key[0])
            self._shares[key] = self.splits_full() and (
                key[1] in ("full", "mask") or self.runner_cfg.decode_shared_forward
                or meta.token_ids.shape[0] > meta.logits_indices.shape[0])
        return self._shares[key]

    def sampler_id(self, key) -> tuple:
        """The sampler program of a step that shares its bucket's forward: (the forward's output, variant, sampling
        layout). A prefill bucket's context variants (their meta layouts differ) share it, and its buffers."""
        if key not in self._sampler_ids:
            self._sampler_ids[key] = (self._forward_out(key[0]), key[1], key[2])
        return self._sampler_ids[key]

    def programs_of(self, key) -> tuple:
        """The program ids a step of `key` runs: its step program, or where it shares its bucket's forward that
        forward and the variant's sampler."""
        return (("forward", key[0]), ("sampler", self.sampler_id(key))) if self.shares_forward(key) else (key,)

    def program(self, pid):
        """What runs program `pid`: the executable warm-up compiled or loaded, else its jitted function."""
        exe = self.executables.get(pid)
        if exe is not None:
            return exe
        kind, key = program_kind(pid)
        return {"forward": self._forward_step_fn, "sampler": self._sampler_step_fn, "step": self._step_fn}[kind](key)

    # ---- resident buffers ---------------------------------------------------------------------------
    def resident(self, key) -> Resident:
        """The resident inbox and outbox of one step program (made on first use), sized from the key's
        layouts: the sampler's result shapes (jax.eval_shape of the sampler alone, on the forward's output)
        and, with RunnerConfig.collect_routing, the routed ids [num_moe_layers, T, k], then with
        RunnerConfig.count_expert_load the step's expert load [num_moe_layers, E]. Where the step shares its
        bucket's forward, its sampler's (`_sampler_resident`, shared with the steps of the same `sampler_id`)."""
        if self.shares_forward(key):
            return self._sampler_resident(self.sampler_id(key))
        if key not in self.residents:
            meta_layout, variant, sampling_layout = key
            parts = (*sizes(meta_layout), *sizes(sampling_layout))  # mi, mf, si, sf
            meta = meta_struct(meta_layout)
            routing = None
            if self.runner_cfg.collect_routing:
                routing = (self.num_moe_layers, meta.token_ids.shape[0], self.cfg.num_experts_per_tok)
            self.residents[key] = self._new_resident(parts, self._forward_out(meta_layout), variant, sampling_layout,
                                                     routing, self.load_shape)
        return self.residents[key]

    @property
    def num_moe_layers(self) -> int:
        return sum(map(self.cfg.is_moe_layer, range(self.cfg.num_hidden_layers)))

    @property
    def load_shape(self) -> tuple[int, int] | None:
        """The expert load counts' shape [num_moe_layers, E] (RunnerConfig.count_expert_load), else None."""
        return (self.num_moe_layers, self.cfg.n_routed_experts) if self.runner_cfg.count_expert_load else None

    def forward_buffers(self, meta_layout: Layout) -> jax.ShapeDtypeStruct:
        """Makes the resident inbox and output of the shared forward of `meta_layout`'s bucket on first use;
        returns the output's key in `forward_outputs`."""
        if meta_layout not in self.forward_inboxes:
            self.forward_inboxes[meta_layout] = self._zeros((sum(sizes(meta_layout)),), jnp.int32)
            self._fwd_out_keys[meta_layout] = self._forward_output(self._forward_out(meta_layout))
        return self._fwd_out_keys[meta_layout]

    def _sampler_resident(self, sid) -> Resident:
        """The resident inbox (the sampling ints and floats alone: parts (0, 0, si, sf)) and outbox of the sampler
        program `sid` (`sampler_id`), made on first use."""
        pid = ("sampler", sid)
        if pid not in self.residents:
            out, variant, sampling_layout = sid
            self.residents[pid] = self._new_resident((0, 0, *sizes(sampling_layout)), out, variant, sampling_layout,
                                                     None)
        return self.residents[pid]

    def _new_resident(self, parts, out: jax.ShapeDtypeStruct, variant: str, sampling_layout: Layout,
                      routing, load=None) -> Resident:
        """Zeroed resident buffers: an inbox int32 [sum(parts)] and an outbox for the sampled tokens of `variant`
        on the forward's output `out` (jax.eval_shape of the sampler), the routed ids `routing` (or None) and the
        expert load counts of shape `load` (or None)."""
        ints_floats = (jax.ShapeDtypeStruct((n,), dt) for n, dt in zip(parts[2:], (jnp.int32, jnp.float32)))
        sampled, _ = jax.eval_shape(self._sample_fn(variant, sampling_layout), out, self.prev_tokens, *ints_floats)
        if self.shapes.mtp_drafts:  # the MTP's drafts a sequence row (`_core_fn`)
            K = self.shapes.mtp_drafts
            drafts = jax.ShapeDtypeStruct((out.shape[0] // (K + 1), K), jnp.int32)
            sampled = dataclasses.replace(sampled, drafts=drafts)
        layout = bits_layout(sampled)
        size = bits_size(layout) + (math.prod(routing) if routing else 0) + (math.prod(load) if load else 0)
        return Resident(parts, self._zeros((sum(parts),), jnp.int32), self._zeros((size,), jnp.int32), layout, routing,
                        load)

    def _zeros(self, shape, dtype):
        """A resident buffer of zeros (see _step_fn), copied from the host: jnp.zeros would compile a program a
        shape on warm-up's lowering thread (23 of them, ~1 s, at serve's flags on an H200)."""
        return jax.device_put(np.zeros(shape, dtype), self.resident_sharding)

    def _forward_out(self, meta_layout: Layout) -> jax.ShapeDtypeStruct:
        """The forward's per-sequence output of one bucket: logits [S, V] fp32."""
        rows = meta_struct(meta_layout).logits_indices.shape[0]
        return jax.ShapeDtypeStruct((rows, self.cfg.vocab_size), jnp.float32)

    def _forward_output(self, out: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        """Makes the resident output buffer of shape `out` the shared forwards write on first use; returns `out`."""
        if out not in self.forward_outputs:
            self.forward_outputs[out] = self._zeros(out.shape, out.dtype)
        return out

    # ---- the jitted functions -----------------------------------------------------------------------
    def _resolver(self):
        """(meta, st, prev_tokens) -> both with the previous step's placeholders resolved on the device:
        runner/step_io.py's, or the overlapped speculating loop's (runner/spec_overlap.py)."""
        if not self.overlap:
            return resolve_placeholders
        rows, k, ps = self.max_rows, self.shapes.mtp_drafts, self.shapes.page_size
        return lambda meta, st, prev: spec_overlap.resolve(meta, st, prev, rows, k, ps)

    def _forward_fn(self, layout: Layout):
        """The jitted forward of one bucket: (params, kv_cache, prev_tokens, ints, floats) ->
        ((logits [S, V] fp32, routing, expert load [num_moe_layers, E] or None), kv_cache). Traced inside
        `_step_fn`'s program (its jaxpr is cached, so a bucket's variants share one trace); not run on its own."""
        if layout not in self.forward_fns:
            cfg, rc, sh, mtp = self.cfg, self.runner_cfg, self.sharding, self.shapes.mtp_drafts
            page_size, count = self.shapes.page_size, rc.count_expert_load
            resolve = self._resolver()

            def forward(params, kv_cache, prev_tokens, ints, floats):
                fam = family_of(cfg)
                # weights in host memory (--cpu-offload-gb): the layers' copied in by the layer loop, one layer at a
                # time, where the family streams them (`fetch`); the others here. Weights on the device as they are.
                params, fetch = stream(params, fam.name)
                meta = resolve(unpack(ints, floats, layout), None, prev_tokens)[0]
                if sh is not None:  # the packed inputs arrive replicated; each device keeps its rows
                    meta = jax.lax.with_sharding_constraint(meta, sh.step_shardings(meta, None)[0])
                unroll = rc.layer_loop(meta.token_ids.shape[0], jax.default_backend())
                switches = {k: v for k, v in rc.forward_switches().items() if k in fam.forward_switches}
                if fetch is not None:
                    switches["layer_fetch"] = fetch
                if mtp:  # the MTP's input: every slot's final-normed hidden state (V4: its last streams)
                    switches["return_hidden"] = True
                out = fam.forward_paged(params, cfg, kv_cache, meta, moe_impl=rc.moe_impl, attn_impl=rc.attn_impl,
                                        return_routing=rc.collect_routing or count, unroll=unroll,
                                        mesh_rules=None if sh is None else sh.mesh_rules, **switches)
                last, kv_cache = out[0], out[1]  # the logits
                if sh is not None:
                    last = jax.lax.with_sharding_constraint(last, sh.logits)
                    kv_cache = jax.lax.with_sharding_constraint(kv_cache, sh.kv_cache)
                load = expert_load(out[2], meta.slot_mapping, page_size, cfg.n_routed_experts) if count else None
                # the second output: the routing (collect_routing), or with MTP drafting (meta, hidden [T, D])
                return (last, (meta, out[-1]) if mtp else out[2] if rc.collect_routing else None, load), kv_cache

            self.forward_fns[layout] = jax.jit(forward)  # the step program donates the cache
        return self.forward_fns[layout]

    def _sample_fn(self, variant: str, layout: Layout):
        """The jitted sampler of one (bucket, variant): (the forward's output, prev_tokens, ints, floats)
        -> (SampledTokens, the next step's prev_tokens [max_rows]). Traced inside `_step_fn`'s program. The mask
        variant is the base one on a sampling layout with the allowed-token bitmask (inputs.build_sampling)."""
        key = (variant, layout)
        if key not in self._smp_fns:
            full, draw = variant == "full", variant != "greedy"
            k, sh, rows = self.max_logprobs if full else 0, self.sharding, self.max_rows
            resolve = self._resolver()

            def sample_step(out, prev_tokens, ints, floats):
                st = resolve(None, unpack(ints, floats, layout), prev_tokens)[1]
                if sh is not None:
                    st = jax.lax.with_sharding_constraint(st, sh.step_shardings(None, st)[1])
                sampled = sample(out, st, max_logprobs=k, full=full, draw=draw)
                # (with speculation, Shapes.spec_width > 1, the engine fetches every step before the next: no
                # placeholder reads these, and the sampling rows may outnumber them)
                ids = sampled.token_ids[:rows]
                nxt = jnp.zeros((rows,), jnp.int32).at[: ids.shape[0]].set(ids)
                if sh is not None:
                    nxt = jax.lax.with_sharding_constraint(
                        nxt, jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec()))
                return sampled, nxt

            self._smp_fns[key] = jax.jit(sample_step)
        return self._smp_fns[key]

    def _core_fn(self, key):
        """The jitted step of one (bucket, variant) on unpacked inputs: (params, kv_cache, prev_tokens,
        meta ints, meta floats, sampling ints, sampling floats) -> ((SampleOutput, routing, load), next
        prev_tokens, kv_cache). The forward's and the sampler's traces are cached per bucket and per
        variant, so tracing the variants of a bucket traces its forward once."""
        if key not in self._core_fns:
            meta_layout, variant, sampling_layout = key
            fwd, smp = self._forward_fn(meta_layout), self._sample_fn(variant, sampling_layout)
            cfg, rc, K = self.cfg, self.runner_cfg, self.shapes.mtp_drafts
            overlap, rows = self.overlap, self.max_rows
            mesh_rules = None if self.sharding is None else self.sharding.mesh_rules

            def core(params, kv_cache, prev_tokens, mi, mf, si, sf):
                (out, routing, load), kv_cache = fwd(params, kv_cache, prev_tokens, mi, mf)
                sampled, nxt = smp(out, prev_tokens, si, sf)
                if K:  # `deepseek_mtp`: the MTP consumes the verified positions and drafts the next K
                    (meta, hidden), routing = routing, None
                    mtp_params = to_device({k: v for k, v in params.items()  # (--cpu-offload-gb)
                                            if k not in ("segments", "layers")})
                    kw = dict(attn_impl=rc.attn_impl, moe_impl=rc.moe_impl)
                    if cfg.family == "deepseek_v4":
                        drafts, kv_cache = v4_mtp_propose(mtp_params, cfg, kv_cache, meta, hidden, sampled.token_ids,
                                                          sampled.accepted, K, mesh_rules=mesh_rules, **kw)
                    else:
                        drafts, kv_cache = mtp_propose(mtp_params, cfg, kv_cache, meta, hidden, sampled.token_ids,
                                                       sampled.accepted, K, mesh_rules=mesh_rules, **kw)
                    sampled = dataclasses.replace(sampled, drafts=drafts)
                    if overlap:  # what the next step's placeholders read (runner/spec_overlap.py)
                        nxt = spec_overlap.next_prev(sampled.token_ids, sampled.accepted, drafts, rows)
                return (sampled, routing, load), nxt, kv_cache

            self._core_fns[key] = jax.jit(core)
        return self._core_fns[key]

    def _forward_step_fn(self, meta_layout: Layout):
        """The jitted shared forward of a prefill bucket (`shares_forward`): (params, kv_cache, prev_tokens,
        inbox, out) -> (kv_cache, out), the cache and `out` donated: the per-sequence output written over `out`
        in place (one address from step to step, as _step_fn's buffers)."""
        pid = ("forward", meta_layout)
        if pid not in self.jitted:
            fwd, parts = self._forward_fn(meta_layout), sizes(meta_layout)

            def forward_step(params, kv_cache, prev_tokens, inbox, out):
                mi, mf = split_inbox(inbox, parts)
                (last, _, _), kv_cache = fwd(params, kv_cache, prev_tokens, mi, mf)
                return kv_cache, jax.lax.dynamic_update_slice(out, last.astype(out.dtype), (0, 0))

            self.jitted[pid] = jax.jit(forward_step, donate_argnums=(1, 4))
        return self.jitted[pid]

    def _sampler_step_fn(self, sid):
        """The jitted sampler program `sid` (`sampler_id`) of a (prefill bucket, variant) (`shares_forward`):
        (the shared forward's output, prev_tokens, inbox, outbox) -> (next prev_tokens, outbox),
        prev_tokens and the outbox donated; the outbox as _step_fn's (no routing)."""
        pid = ("sampler", sid)
        if pid not in self.jitted:
            smp, res = self._sample_fn(sid[1], sid[2]), self._sampler_resident(sid)

            def sampler_step(out, prev_tokens, inbox, outbox):
                si, sf = split_inbox(inbox, res.parts[2:])
                sampled, nxt = smp(out, prev_tokens, si, sf)
                return nxt, jax.lax.dynamic_update_slice(outbox, pack_bits((sampled, None)), (0,))

            # keep_unused: a variant that reads no placeholder leaves prev_tokens unused, and jit would drop it and
            # its donation, so the next ids would land at a new address (and the next decode step's CUDA graph be
            # recorded again)
            self.jitted[pid] = jax.jit(sampler_step, donate_argnums=(1, 3), keep_unused=True)
        return self.jitted[pid]

    def _step_fn(self, key):
        """The jitted step program of one (bucket, variant): (params, kv_cache, prev_tokens, inbox,
        outbox) -> (kv_cache, next prev_tokens, outbox), the cache, prev_tokens and outbox donated.

        Every buffer its CUDA graph touches keeps one address from step to step, so XLA replays the
        graph as recorded. The step's host inputs arrive in a fresh buffer that a small program
        (the runner's `_stage`) copies into this program's resident inbox; the results (packed, pack_bits)
        overwrite its resident outbox, which another small program (`extract_results`) copies out for the
        host. Fed fresh buffers instead, XLA's VA remapping left 8 of the graph's allocations out and
        re-recorded the ~700-command graph at every step of the engine: ~1 ms of host time and the
        graph's upload on the device. For the same reason the forward and the sampler are one program: as
        two, the forward's graph was re-recorded at every step (1.6 ms), its output then a fresh buffer each
        step. (RunnerConfig.prefill_shared_forward's two programs keep every buffer resident:
        `_forward_step_fn`.)"""
        if key not in self.jitted:
            core, res = self._core_fn(key), self.resident(key)
            # no `self` in the closure: the runner (and its KV cache) must go when its owner drops it
            resident_sharding = self.resident_sharding if self.sharding is not None else None

            def step(params, kv_cache, prev_tokens, inbox, outbox):
                mi, mf, si, sf = split_inbox(inbox, res.parts)
                results, nxt, kv_cache = core(params, kv_cache, prev_tokens, mi, mf, si, sf)
                sampled, routing, load = results
                if (bits_layout(sampled) != res.sampled_layout or
                        (None if routing is None else routing.shape) != res.routing_shape or
                        (None if load is None else load.shape) != res.load_shape):
                    raise AssertionError(f"step results {results} do not fit the outbox made for them")
                outbox = jax.lax.dynamic_update_slice(outbox, pack_bits(results), (0,))  # in place
                if resident_sharding is not None:
                    outbox = jax.lax.with_sharding_constraint(outbox, resident_sharding)
                return kv_cache, nxt, outbox

            self.jitted[key] = jax.jit(step, donate_argnums=(1, 2, 4))
        return self.jitted[key]

    # ---- warm-up ------------------------------------------------------------------------------------
    def program_key(self, pid, state_signature: tuple) -> str:
        """The program cache's key of program `pid` (runner/program_cache.py): the configurations, shapes, the
        program's layouts (which fix its inbox and outbox) and `state_signature`, the signature of the arguments
        every step program shares (params, KV cache, previous tokens); the cache adds the code and the device."""
        rc = dataclasses.replace(self.runner_cfg, program_cache_dir=None)
        kind, key = program_kind(pid)
        if kind == "forward":
            layouts = (key, sizes(key), self._forward_out(key))
        else:
            res = self._sampler_resident(key) if kind == "sampler" else self.resident(key)
            layouts = (key, res.parts, res.sampled_layout, res.routing_shape)
            if res.load_shape is not None:
                layouts += (res.load_shape,)
        return program_cache.program_key(kind, self.cfg, rc, self.shapes, self.num_pages, self.max_logprobs,
                                         *layouts, state_signature)

    def lower(self, pid, params, kv_cache, prev_tokens):
        """Trace and lower program `pid` on the runner's state and its resident buffers."""
        return self.trace(pid, params, kv_cache, prev_tokens).lower()

    def trace(self, pid, params, kv_cache, prev_tokens):
        """Trace program `pid` on the runner's state and its resident buffers (jax's Traced: its `.jaxpr`)."""
        kind, key = program_kind(pid)
        if kind == "forward":
            out = self.forward_buffers(key)
            return self._forward_step_fn(key).trace(params, kv_cache, prev_tokens, self.forward_inboxes[key],
                                                    self.forward_outputs[out])
        if kind == "sampler":
            res, out = self._sampler_resident(key), self.forward_outputs[self._forward_output(key[0])]
            return self._sampler_step_fn(key).trace(out, prev_tokens, res.inbox, res.outbox)
        res = self.resident(key)
        return self._step_fn(key).trace(params, kv_cache, prev_tokens, res.inbox, res.outbox)


def expert_load(routing: jax.Array, slot_mapping: jax.Array, page_size: int, num_experts: int) -> jax.Array:
    """routing [num_moe_layers, T, k] logical expert ids -> int32 [num_moe_layers, E]: the step's token copies
    routed to each expert, padding tokens (they write into the null page, slots below page_size) left out."""
    L = routing.shape[0]
    real = (slot_mapping >= page_size).astype(jnp.int32)  # [T]
    layer = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[:, None, None], routing.shape)
    ones = jnp.broadcast_to(real[None, :, None], routing.shape)
    return jnp.zeros((L, num_experts), jnp.int32).at[layer, routing].add(ones)
