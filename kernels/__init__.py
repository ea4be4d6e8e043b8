"""Hot-path kernels, installed as `deepinfer_jax.kernels`.

Each kernel comes in three parts (ARCHITECTURE.md rule 6): the Pallas kernel, a wrapper with an
`interpret=` flag so it runs on the CPU, and a pure-JAX reference that defines the semantics.
"""

# Importing Pallas' fuser registers a JAX config flag that is part of the trace context. Some Pallas
# paths import it lazily at run time, which changes the context and recompiles every warmed-up step;
# importing it here, before any warm-up, keeps the context fixed.
import jax.experimental.pallas.fuser  # noqa: E402, F401
