"""An L2 prefetch of a decode step's MoE weights, run beside the attention's latency-bound kernels.

At batch 32 the single MoE launch (kernels/moe_gmm.py) streams ~1.1 GB of expert weights a layer at ~4.5
TB/s, while for ~57 us before it the attention side's ~14 small kernels leave the DRAM mostly idle. This
kernel loads the first `rows` rows (of D) of the first `experts` experts' gate_up weights at `layer` into
L2 (evict-last): the MoE launch starts its first wave of gate_up tiles on those experts (block-major,
experts in id order; at batch 32 nearly every expert is routed to), each tile walking its rows from the
first. Its output, a throwaway [programs, row] of the tiles' elementwise max (which keeps the loads),
goes to the MoE launch as an operand it never reads: the launch then runs after it. Its input `dep`,
also never read, places its start: with XLA's concurrent command buffers
(`--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`) the prefetch runs beside the kernels between
`dep`'s producer and the MoE launch. Session 13 ran the same loads inside the routing launch, where
they were on the critical path (benchmarks/RESULTS.md).

Grid: `programs`. The weights are viewed flat as [-1, row_width] (ROW elements at V2-Lite's shape); the region is cut into tiles of `tile`
such rows, and program p loads tiles p, p + programs, ... (`unroll` loads in flight at a time); tiles past
the region's end load its last tile again.

`l2_prefetch_reference` (pure JAX) defines the output; `interpret=True` runs the kernel on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.triton_params import compiler_params

ROW = 1024  # elements a row of the weights' flat view (2 KB in bf16), at most


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """What to prefetch and how: `experts` x `rows` rows of gate_up; `programs` programs walking `tile`-row
    tiles of the flat view, `unroll` at a time; `after`: the layer's point it starts from ("h": the layer's
    input, "q": the absorbed query, "a": the attention's output)."""
    experts: int
    rows: int
    programs: int = 32
    tile: int = 8
    unroll: int = 4
    after: str = "h"

    @classmethod
    def parse(cls, spec: str) -> "Prefetch | None":
        """"experts,rows[,programs,tile,unroll,after]" (RunnerConfig.moe_l2_prefetch) -> Prefetch; "" -> None."""
        if not spec:
            return None
        parts = spec.split(",")
        if not 2 <= len(parts) <= 6:
            raise ValueError(f"moe_l2_prefetch {spec!r}: experts,rows[,programs,tile,unroll,after]")
        ints = [int(v) for v in parts[:5]]
        p = cls(*ints, *parts[5:])
        if min(ints) <= 0 or p.after not in ("h", "q", "a"):
            raise ValueError(f"moe_l2_prefetch {spec!r}: positive sizes and after in h, q, a")
        return p


def row_width(shape: tuple) -> int:
    """The flat view's row for gate_up [L, E, D, 2, I]: ROW elements, or the largest power of two dividing an
    expert's D * 2 * I elements where that is fewer."""
    n = shape[-3] * shape[-2] * shape[-1]
    return min(ROW, n & -n)


def _tiles(shape: tuple, p: Prefetch) -> tuple[int, int, int, int, int]:
    """(experts, tiles an expert, tile rows, flat rows an expert, flat rows a layer) for gate_up [L, E, D, 2, I]
    viewed as [-1, row_width]; an expert's first p.rows rows, rounded down to whole rows of that view, cut into
    tiles of the largest of p.tile, 8, 4, 2, 1 rows (at most p.tile) that divides them."""
    _, E, D, two, I = shape
    per_expert = D * two * I // row_width(shape)
    span = max(1, min(p.rows, D) * two * I // row_width(shape))
    tile = max(t for t in (p.tile, 8, 4, 2, 1) if t <= p.tile and span % t == 0)
    return min(p.experts, E), span // tile, tile, per_expert, E * per_expert


def _start(t, layer, per_tile, tile, per_expert, per_layer):
    """The first flat row of tile t (expert t // per_tile, its (t % per_tile)-th tile) at `layer`."""
    return layer * per_layer + (t // per_tile) * per_expert + (t % per_tile) * tile


def _kernel(layer_ref, dep_ref, w_ref, out_ref, *, n_tiles, per_tile, tile, per_expert, per_layer, programs,
            steps, unroll):
    del dep_ref  # only orders the launch
    from jax.experimental.pallas import triton as plgpu

    p = pl.program_id(0)
    layer = layer_ref[0]

    def load(t):
        start = _start(jnp.minimum(t, n_tiles - 1), layer, per_tile, tile, per_expert, per_layer)
        return plgpu.load(w_ref.at[pl.ds(start, tile), :], eviction_policy="evict_last")

    def body(i, acc):  # `unroll` independent loads, all issued before their maxima
        for v in [load(p + (i * unroll + u) * programs) for u in range(unroll)]:
            acc = jnp.maximum(acc, v)
        return acc

    acc = jax.lax.fori_loop(0, steps, body, jnp.full((tile, w_ref.shape[1]), -jnp.inf, w_ref.dtype))
    out_ref[pl.ds(p, 1), :] = jnp.max(acc, axis=0, keepdims=True)


def _plan(shape, p: Prefetch):
    experts, per_tile, tile, per_expert, per_layer = _tiles(shape, p)
    n_tiles = experts * per_tile
    steps = -(-n_tiles // (p.programs * p.unroll))
    return dict(n_tiles=n_tiles, per_tile=per_tile, tile=tile, per_expert=per_expert, per_layer=per_layer,
                programs=p.programs, steps=steps, unroll=p.unroll)


@functools.partial(jax.jit, static_argnames=("prefetch", "interpret"))
def l2_prefetch(w_gate_up, layer, dep, *, prefetch: Prefetch, interpret=False):
    """w_gate_up [L, E, D, 2, I] (read in place), layer int32 (scalar or [1]), dep any array (orders the
    launch, never read) -> [programs, row_width] in w_gate_up's dtype: row p the elementwise max of program
    p's tiles (module docstring)."""
    plan, row = _plan(w_gate_up.shape, prefetch), row_width(w_gate_up.shape)
    return pl.pallas_call(
        functools.partial(_kernel, **plan),
        grid=(prefetch.programs,),
        out_shape=jax.ShapeDtypeStruct((prefetch.programs, row), w_gate_up.dtype),
        compiler_params=compiler_params(4, 1, interpret), interpret=interpret,
    )(jnp.asarray(layer, jnp.int32).reshape(1), dep, w_gate_up.reshape(-1, row))


def l2_prefetch_reference(w_gate_up, layer, *, prefetch: Prefetch):
    """Pure JAX: the same [programs, row_width] as `l2_prefetch`."""
    plan = _plan(w_gate_up.shape, prefetch)
    flat = w_gate_up.reshape(-1, row_width(w_gate_up.shape))
    n = plan["steps"] * plan["unroll"]
    t = jnp.minimum(jnp.arange(prefetch.programs)[:, None] + jnp.arange(n)[None, :] * prefetch.programs,
                    plan["n_tiles"] - 1)  # [programs, n]
    start = _start(t, jnp.asarray(layer, jnp.int32).reshape(()), plan["per_tile"], plan["tile"],
                   plan["per_expert"], plan["per_layer"])
    rows = flat[start[..., None] + jnp.arange(plan["tile"])]  # [programs, n, tile, row]
    return rows.max(axis=(1, 2))
