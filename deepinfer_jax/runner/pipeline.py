"""Pipeline parallelism on the device: one program a stage, each on its own devices; micro-batches in flight.

`PipelineRunner` is a ModelRunner (same host side: `prepare`, `dispatch`, `fetch`, placeholders, data-parallel
ranks) whose step is a chain of programs instead of one (sharding/pipeline.py lays the stages out):

- stage 0: embedding and its layers, [T, D] hidden states out;
- stage r (0 < r < last): its layers on the hidden states the stage before computed, moved onto its devices
  (`jax.device_put` from one stage's devices to the next's: the only bytes that cross stages, T x D a step);
- the last stage: its layers, the final norm and lm_head (the logits [S, V]), then the sampling variant's sampler
  as a program of its own on the same devices (the variants of a bucket share its stages' programs); the sampled
  ids (the next step's placeholders, ModelRunner.dispatch) are copied back to stage 0 for its embedding.

Each stage holds its own layers' params and its own KV cache [its layers, pages, ...] with the same page ids (every
stage sees the same step metadata), so the scheduler, prefix caching and preemption are those of one model.

Micro-batches: `prepare` may split a prefill-bucket step into M micro-batches of whole sequences, each padded to a
smaller bucket of the same ladder (runner/micro_batches.py: which steps, how many, and why decode steps are not).
`run` then queues them GPipe's way, micro-batch after micro-batch through the stages, with no host sync between:
JAX's dispatch is asynchronous and each stage's programs run on its own devices in the order queued, so stage s
computes micro-batch k while stage s + 1 computes micro-batch k - 1 (a stage's cache is threaded from one
micro-batch to the next, so a later one sees the pages an earlier one wrote). The last stage's logits of all of
them are gathered back into the step's rows (a small program per (M, micro bucket, step bucket), compiled at
warm-up) and sampled once, as the step unsplit would be. Counters: `stage_dispatches` (stage programs queued, per
stage), `micro_batch_counts` (steps by their number of micro-batches), and `stage_boundary_bytes` (the hidden
states moved between stages, all steps).
Decode groups (`decode_groups` = the number of stages): the engine keeps a step of each of that many disjoint groups
of requests in flight (engine/llm_engine.py), and a group's step reads its placeholders from that group's own last
sampled ids: `select_group(g)` swaps in group g's buffer (same shape and sharding, so nothing recompiles). Group
g + 1's stage 0 then depends on nothing of group g's step but stage 0's cache, and runs while group g's step is in
the later stages. `group_steps` counts the steps run, per group.

Not with pipeline parallelism (refused, naming the option): speculative decoding, prompt logprobs, the host tier of
the KV cache, routing collection, several hosts.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig, RunnerConfig
from deepinfer_jax.models.pipeline import stage_tree
from deepinfer_jax.models.registry import family_of, kv_cache_shape
from deepinfer_jax.runner import micro_batches, warmup
from deepinfer_jax.runner.compile_cache import CompileCounter
from deepinfer_jax.runner.device_memory import device_memory
from deepinfer_jax.runner.inputs import HostStep, PageRows, Shapes, build_metadata, next_pow2
from deepinfer_jax.runner.micro_batches import PipelineStep
from deepinfer_jax.runner.model_runner import ModelRunner
from deepinfer_jax.runner.packing import pack, pack_bits, sizes, unpack
from deepinfer_jax.runner.step_io import StepOut, packed, resolve_placeholders, split_inbox
from deepinfer_jax.runner.step_programs import StepPrograms
from deepinfer_jax.sharding.data_parallel import merge_rank_metas
from deepinfer_jax.weights.pending import PendingParams


FLAG = "--pipeline-parallel-size > 1"


def runner_class(sharding: Any) -> type:
    """The engine's runner for `sharding`: PipelineRunner where it has pipeline stages (sharding/pipeline.py), else
    ModelRunner."""
    return PipelineRunner if getattr(sharding, "pipeline_parallel_size", 1) > 1 else ModelRunner


def kv_sizing_config(cfg: ModelConfig, sharding: Any) -> ModelConfig:
    """The config whose KV cache bytes a page are one device's (runner/device_memory.py pages_for_memory): with
    pipeline stages, a device caches its stage's layers only, so the largest stage's layer count."""
    if getattr(sharding, "pipeline_parallel_size", 1) == 1:
        return cfg
    return dataclasses.replace(cfg, num_hidden_layers=max(st.num_layers for st in sharding.stages))


def _cut(tree: Any, offset: int, n: int) -> Any:
    """A stacked segment's leaves -> layers [offset, offset + n) of them (the whole leaf as it is where that is all
    of it: a segment that one stage holds is not copied)."""
    return jax.tree.map(lambda a: a if (offset, n) == (0, a.shape[0]) else a[offset:offset + n], tree)


class PipelineRunner(ModelRunner):
    def __init__(self, cfg: ModelConfig, params: Any, runner_cfg: RunnerConfig, shapes: Shapes,
                 num_pages: int, max_logprobs: int = 20, sharding: Any = None):
        if shapes.spec_width > 1:
            raise ValueError(f"speculative_config is not supported with {FLAG}")
        if runner_cfg.collect_routing:
            raise ValueError(f"collect_routing is not supported with {FLAG}")
        CompileCounter.install()
        if isinstance(params, PendingParams):
            params = params.result()
        self.cfg, self.runner_cfg, self.shapes, self.num_pages = cfg, runner_cfg, shapes, num_pages
        self.max_logprobs, self.kv_dtype = max_logprobs, jnp.dtype(runner_cfg.kv_dtype)
        self.sharding, self.num_ranks = sharding, sharding.num_ranks
        self.stages, self.stage_shardings = sharding.stages, sharding.shardings
        self._pending, self._mark_context, self.params = None, False, None
        self.page_rows = PageRows()
        self.stage_params, self.stage_caches = [], []
        full_shape = kv_cache_shape(cfg, num_pages * self.num_ranks, shapes.page_size)
        for st, sh in zip(self.stages, self.stage_shardings):
            part = stage_tree(params, cfg, st, _cut)
            self.stage_params.append(jax.device_put(part, sharding.stage_param_shardings(cfg, params, st.rank)))
            self.stage_caches.append(jnp.zeros((st.num_layers, *full_shape[1:]), self.kv_dtype, device=sh.kv_cache))
        del params
        self.max_rows = self.num_ranks * next_pow2(shapes.max_num_seqs)
        # The last stage's programs: the resident layouts of each step's results, and the samplers.
        self.programs = StepPrograms(cfg, runner_cfg, shapes, num_pages, max_logprobs, self.stage_shardings[-1],
                                     self.max_rows)
        self._replicated = [jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec())
                            for sh in self.stage_shardings]
        self._hidden = [jax.sharding.NamedSharding(sh.mesh, sh.mesh_rules.spec(("tokens", None)))
                        for sh in self.stage_shardings]  # [T, D]: tokens over the data axis, as the step's
        self._prev_tokens = jax.device_put(jnp.zeros((self.max_rows,), jnp.int32), self._replicated[-1])
        last = self.stage_shardings[-1]  # a split step's gather index [R, S / R]: each data rank's rows on its devices
        self._by_rank = jax.sharding.NamedSharding(last.mesh, last.mesh_rules.spec(("seqs", None)))
        self._fns: dict[Any, Any] = {}  # (stage rank, meta layout), ("sampler", a step's key) or ("gather", M) -> jit
        self._warm = False
        self._init_state()
        self.stage_dispatches = [0] * len(self.stages)  # stage programs queued, per stage (a micro-batch each)
        self.micro_batch_counts: Counter[int] = Counter()  # steps run, by their number of micro-batches
        self.stage_boundary_bytes = 0  # hidden states [T, D] moved from a stage to the next, all steps together
        self._hidden_row_bytes = cfg.hidden_size * jnp.dtype(runner_cfg.dtype).itemsize
        self.decode_groups = len(self.stages)
        self._group, self._group_prev = 0, [self._prev_tokens]  # the selected group; each group's sampled ids
        self.group_steps = [0] * self.decode_groups

    @property
    def kv_cache(self):
        """The last stage's cache (every stage's has the same pages; `stage_caches` holds them all)."""
        return self.stage_caches[-1]

    # ---- reporting ---------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, Any]:
        """ModelRunner.memory_report summed over the stages' devices."""
        leaves = [x for p in self.stage_params for x in jax.tree_util.tree_leaves(p) if hasattr(x, "nbytes")]
        devices = [d for c in self.stage_caches for d in c.sharding.device_set]
        out: dict[str, Any] = {"weights": sum(int(x.nbytes) for x in leaves),
                               "kv_cache": sum(int(c.nbytes) for c in self.stage_caches),
                               "platform": devices[0].platform, "device_kind": devices[0].device_kind,
                               "num_devices": len(devices), "limit": None, "in_use": None}
        mems = [device_memory(d) for d in devices]
        if all(m is not None for m in mems):
            out["limit"], out["in_use"] = sum(m.limit for m in mems), sum(m.in_use for m in mems)
        return out

    # ---- what pipeline parallelism does not run ----------------------------------------------------
    def enable_host_tier(self, num_host_blocks: int) -> None:
        raise ValueError(f"kv_offloading_size is not supported with {FLAG}")

    def score_prompt(self, token_ids: list[int]):
        raise ValueError(f"prompt_logprobs is not supported with {FLAG}")

    # ---- warm-up -----------------------------------------------------------------------------------
    def warmup(self, progress: bool = True) -> int:
        """Run each warm-up step (runner/warmup.py `plan`: a padding step a bucket and sampling variant) once,
        which compiles its stages' programs; returns the number of programs compiled."""
        hosts, _ = warmup.plan(self)
        hosts += self._micro_warmup_steps()
        for host in hosts:
            for _ in range(max(1, self.runner_cfg.warmup_runs)):
                jax.block_until_ready(self.run(host).buf)
        self._warm = True
        self.stage_dispatches = [0] * len(self.stages)
        self.micro_batch_counts.clear()
        self.stage_boundary_bytes = 0
        # Every group's ids in the layout the sampler returns, which the programs compiled for.
        self._group, self.group_steps = 0, [0] * self.decode_groups
        self._group_prev = [self._prev_tokens] + [jax.device_put(np.zeros(self.max_rows, np.int32),
                                                                 self._prev_tokens.sharding)
                                                  for _ in range(self.decode_groups - 1)]
        return len(self._fns)

    def select_group(self, group: int) -> None:
        """Run the next steps for decode group `group` (module docstring): their placeholders read the ids that
        group's last step sampled, and their samples go to that group's buffer."""
        self._group_prev[self._group] = self._prev_tokens
        self._prev_tokens, self._group = self._group_prev[group], group

    def _micro_warmup_steps(self) -> list[PipelineStep]:
        """A padding step for each (bucket, M, micro bucket) a real step may be split into (micro_batches.candidates),
        in the base variant: their stages' programs are the buckets' own, the logits gather is new."""
        out = []
        for bucket in self.shapes.buckets:
            for m, b in micro_batches.candidates(self.shapes, bucket, len(self.stages)):
                mi, mf, ml = pack(self.padding_step(b, False).meta)
                packed_meta = (ml, np.concatenate([mi, mf.view(np.int32)]))
                rows = self.num_ranks * self.shapes.seq_rows(bucket)
                out.append(PipelineStep.of(self.padding_step(bucket, False), [packed_meta] * m, b,
                                           np.zeros((self.num_ranks, rows // self.num_ranks), np.int32)))
        return out

    # ---- micro-batches (runner/micro_batches.py) ---------------------------------------------------
    def prepare(self, plan_seqs, requests, seeds, ranks=None, masks: bool = True) -> HostStep:
        """ModelRunner.prepare's step, with its micro-batches (a PipelineStep) where micro_batches.choose splits it."""
        host = super().prepare(plan_seqs, requests, seeds, ranks, masks)
        groups = ([list(plan_seqs)] if self.num_ranks == 1 else
                  [[s for s, r in zip(plan_seqs, ranks) if r == k] for k in range(self.num_ranks)])
        split = micro_batches.choose(groups, self.shapes, host.bucket, len(self.stages))
        if split is None:
            return host
        b, rows = split.bucket, self.shapes.seq_rows(split.bucket)
        micro = []
        for ranks_idx in split.parts:
            metas = [build_metadata([g[i] for i in idx], self.shapes, b, page_rows=self.page_rows)
                     for g, idx in zip(groups, ranks_idx)]
            mi, mf, ml = pack(metas[0] if self.num_ranks == 1 else merge_rank_metas(metas, b))
            micro.append((ml, np.concatenate([mi, mf.view(np.int32)])))
        index = micro_batches.gather_index(split, self.num_ranks, self.shapes.seq_rows(host.bucket), rows)
        return PipelineStep.of(host, micro, b, index)

    # ---- the step ----------------------------------------------------------------------------------
    def defers_masks(self, plan_seqs, requests) -> bool:
        """Never: a pipelined step's structured-output masks are filled before it is queued (`run` takes no
        before_sampling)."""
        return False

    def run(self, host: HostStep, before_sampling=None) -> StepOut:
        """Queue each micro-batch's programs stage after stage (module docstring; a step not split is one
        micro-batch), the logits gather of a split step, then the sampler on the last stage's devices; returns its
        results."""
        if before_sampling is not None:
            raise ValueError("a pipelined step fills its structured-output masks before it is queued")
        key, inputs = packed(host)
        res = self.programs.resident(key)  # the layout of the results
        n_meta = sum(sizes(key[0]))
        micro = getattr(host, "micro", ()) or ((key[0], inputs[:n_meta]),)
        prev = jax.device_put(self._prev_tokens, self._replicated[0])  # the placeholders' ids, for stage 0
        logits = []
        for layout, meta_inputs in micro:  # GPipe's order: stage s of micro-batch k runs beside s + 1 of k - 1
            out = None  # stage r's output: hidden states [T, D], on the last stage the logits [S, V]
            for st in self.stages:
                rep = self._replicated[st.rank]
                if not st.first:
                    out = jax.device_put(out, self._hidden[st.rank])  # from the stage before's devices
                    self.stage_boundary_bytes += out.shape[0] * self._hidden_row_bytes
                out, self.stage_caches[st.rank] = self._stage_fn(st.rank, layout)(
                    self.stage_params[st.rank], self.stage_caches[st.rank], prev if st.first else None,
                    jax.device_put(meta_inputs, rep), out)
                self.stage_dispatches[st.rank] += 1
            logits.append(out)
        self.micro_batch_counts[len(logits)] += 1
        self.group_steps[self._group] += 1
        if len(logits) > 1:  # the micro-batches' rows back in the step's order
            out = self._gather_fn(len(logits))(jax.device_put(host.gather, self._by_rank), *logits)
        self._prev_tokens, outbox = self._sampler_fn(key)(out, self._prev_tokens,
                                                          jax.device_put(inputs[n_meta:], self._replicated[-1]))
        return StepOut(outbox, res.sampled_layout, None)

    def _gather_fn(self, m: int):
        """(index [R, S / R], M micro-batches' logits [S_b, V] each) -> the step's logits [S, V] (R data ranks, each
        row block a rank's: micro_batches.gather_index), on the last stage's devices, laid out as its stage program
        lays logits out. Each rank gathers from its own rows: the batched gather over the rank axis stays on the
        devices that hold it, no logits move between ranks."""
        if ("gather", m) not in self._fns:
            sh, R = self.stage_shardings[-1], self.num_ranks
            by_rank = jax.sharding.NamedSharding(sh.mesh, sh.mesh_rules.spec(("seqs", None, None)))

            def gather(index, *parts):
                x = jnp.stack([p.reshape(R, -1, p.shape[-1]) for p in parts], axis=1)  # [R, M, S_b / R, V]
                x = jax.lax.with_sharding_constraint(x.reshape(R, -1, x.shape[-1]), by_rank)  # [R, M x S_b / R, V]
                out = jnp.take_along_axis(x, index[:, :, None], axis=1)  # [R, S / R, V]
                return out.reshape(-1, out.shape[-1])

            self._fns[("gather", m)] = jax.jit(gather, out_shardings=sh.logits)
        return self._fns[("gather", m)]

    def _forward(self, rank: int):
        """Stage `rank`'s forward, to trace inside its program: (params, cache, prev_tokens, meta ints, meta floats,
        meta layout, hidden) -> (hidden [T, D], or on the last stage logits [S, V] fp32; its cache)."""
        cfg, rc, st, sh = self.cfg, self.runner_cfg, self.stages[rank], self.stage_shardings[rank]
        fam = family_of(cfg)
        switches = {k: v for k, v in rc.forward_switches().items() if k in fam.forward_switches}
        out_sharding = sh.logits if st.last else self._hidden[rank]

        def forward(params, cache, prev_tokens, mi, mf, layout, hidden):
            meta = unpack(mi, mf, layout)
            if st.first:
                meta = resolve_placeholders(meta, None, prev_tokens)[0]
            meta = jax.lax.with_sharding_constraint(meta, sh.step_shardings(meta, None)[0])
            out, cache = fam.forward_paged(params, cfg, cache, meta, moe_impl=rc.moe_impl, attn_impl=rc.attn_impl,
                                           unroll=rc.layer_loop(meta.token_ids.shape[0], jax.default_backend()),
                                           mesh_rules=sh.mesh_rules, stage=st, hidden=hidden, **switches)
            out = jax.lax.with_sharding_constraint(out, out_sharding)
            return out, jax.lax.with_sharding_constraint(cache, sh.kv_cache)

        return forward

    def _stage_fn(self, rank: int, layout):
        """Stage `rank` of a bucket: (params, cache, prev_tokens or None, meta inbox, hidden or None) -> (hidden
        [T, D], or on the last stage the logits [S, V] fp32; cache), the cache donated."""
        if (rank, layout) not in self._fns:
            parts, fwd = sizes(layout), self._forward(rank)  # no `self` in the program's closure

            def stage(params, cache, prev_tokens, inbox, hidden):
                mi, mf = split_inbox(inbox, parts)
                return fwd(params, cache, prev_tokens, mi, mf, layout, hidden)

            self._fns[(rank, layout)] = jax.jit(stage, donate_argnums=1)
        return self._fns[(rank, layout)]

    def _sampler_fn(self, key):
        """The sampler of a step of `key` on the last stage's devices: (logits [S, V], prev_tokens, sampling inbox)
        -> (the next prev_tokens, the packed sampled tokens), prev_tokens donated. A bucket's sampling variants share
        its stages' programs; each has its own (small) sampler program."""
        if ("sampler", key) not in self._fns:
            _, variant, sampling_layout = key
            parts = self.programs.resident(key).parts[2:]
            smp = self.programs._sample_fn(variant, sampling_layout)  # the one-program step's sampler

            def sampler(logits, prev_tokens, inbox):
                si, sf = split_inbox(inbox, parts)
                sampled, nxt = smp(logits, prev_tokens, si, sf)
                return nxt, pack_bits((sampled, None))

            # keep_unused: a variant that reads no placeholder leaves prev_tokens unused (see step_programs.py)
            self._fns[("sampler", key)] = jax.jit(sampler, donate_argnums=1, keep_unused=True)
        return self._fns[("sampler", key)]
