"""JAX: arrays and pytrees; Flax, Equinox and optax, each its own registry row."""
