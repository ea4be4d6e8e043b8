"""Hot-path kernels, installed as `deepinfer_jax.kernels`.

Each kernel comes in three parts (ARCHITECTURE.md rule 6): the Pallas kernel, a wrapper with an
`interpret=` flag so it runs on the CPU, and a pure-JAX reference that defines the semantics.
"""
