"""Producer / consumer order between the programs of one Pallas (Triton) launch, on atomic counters.

Several kernels put two or more dependent steps of a layer into one 1-D grid: the producers come first,
each storing its tile and then adding 1 to a counter (`release`), and a consumer spins on the counter
until every producer it needs has added its 1 (`acquire`) before it reads their tiles. CUDA starts a 1-D
grid's programs in order, so every producer has started before any consumer waits, and producers never
wait: no deadlock. The counters are a zeroed int32 operand aliased to an output.

In interpret mode (`spin=False`) the programs run one after another, so every earlier program is done
and a consumer does not wait; the counters are still added to.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def release(cnt_ref, i, spin: bool) -> None:
    """Add 1 to counter i (a Python or traced int) after every thread's stores of this program (a CTA barrier, then an atomic
    add with release semantics)."""
    from jax.experimental.pallas import triton as plgpu

    if spin:
        plgpu.debug_barrier()  # every thread's stores precede the release below
    plgpu.atomic_add(cnt_ref, jnp.asarray(i, jnp.int32), jnp.int32(1))


def acquire(cnt_ref, i, target, spin: bool) -> None:
    """Spin until counter i reaches `target` (atomic reads with acquire semantics)."""
    from jax.experimental.pallas import triton as plgpu

    if spin:
        i = jnp.asarray(i, jnp.int32)
        read = lambda _: plgpu.atomic_add(cnt_ref, i, jnp.int32(0))  # noqa: E731  acquire
        jax.lax.while_loop(lambda r: r < target, read, read(None))

