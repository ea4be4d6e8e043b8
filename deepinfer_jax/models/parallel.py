"""What the model needs to know about a device mesh: a static `MeshRules` (mesh + logical-axis rules).

The rule tables themselves live in `deepinfer_jax/sharding/rules.py`; this file only maps logical axis
names onto mesh axes so the model's `shard_map` wrappers (paged attention in deepseek.py, routed
experts in moe.py) can state their in/out specs in the params' own vocabulary. Without a MeshRules
(`mesh_rules=None`) the model runs exactly the single-device code.

Logical axes used for activations (besides the param axes of params.py):
  "tokens" [T] flattened step tokens, "seqs" [S] sequence rows, "pages" [P] KV cache pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from jax.sharding import Mesh, PartitionSpec


@dataclass(frozen=True)
class MeshRules:
    """A mesh and `rules`: (logical axis, mesh axes) pairs; a logical axis not named is replicated.
    Frozen and hashable, so jitted step functions may close over it. `moe_dispatch`: how the routed experts
    reach tokens of other devices under expert parallelism, "allgather_reducescatter" (every device sees every
    token) or "all_to_all" (each token sent only to the devices of its experts; models/moe_a2a.py)."""

    mesh: Mesh
    rules: tuple[tuple[str, tuple[str, ...]], ...]
    moe_dispatch: str = "allgather_reducescatter"

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        for name, axes in self.rules:
            if name == logical:
                return axes
        return ()

    def size(self, logical: str | None) -> int:
        n = 1
        for a in self.mesh_axes(logical):
            n *= self.mesh.shape[a]
        return n

    def spec(self, axes: Sequence[str | None]) -> PartitionSpec:
        """Logical axes of an array -> its PartitionSpec on this mesh."""
        return logical_to_spec(axes, self.rules)


def logical_to_spec(axes: Sequence[str | None], rules: tuple[tuple[str, tuple[str, ...]], ...]) -> PartitionSpec:
    """("layers", "expert", "embed") with rules {"expert": ("data", "tensor")} -> P(None, ("data", "tensor"), None)."""
    table = dict(rules)
    out = []
    for logical in axes:
        m = table.get(logical, ()) if logical is not None else ()
        out.append(None if not m else m[0] if len(m) == 1 else tuple(m))
    return PartitionSpec(*out)
