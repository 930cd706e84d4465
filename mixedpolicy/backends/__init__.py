"""One folder per framework, each with the same file names for the same parts.

- ``numpy/arrays.py``
- ``torch/arrays.py``, ``torch/modules.py``, ``torch/optimizer.py`` (and ``checks.py``,
  ``state.py``: what the optimizer refuses, and what it saves)
- ``jax/arrays.py``, ``jax/flax.py`` (NNX's in ``flax_nnx.py``, what NNX and linen share in
  ``flax_common.py``), ``jax/equinox.py``, ``jax/optax.py``
- ``keras/layers.py``, ``keras/optimizer.py`` (Keras tensors use their backend's arrays)
- ``tensorflow/arrays.py``, ``tensorflow/modules.py``

``arrays`` files hold an `ArrayOps`, ``modules`` / ``layers`` / ``flax`` / ``equinox``
a `ModelAdapter`, ``optimizer`` / ``optax`` an `OptimizerAdapter`
(`mixedpolicy._adapter`). `mixedpolicy._registry` has one row per framework naming
them; nothing here is imported until the framework itself is.
"""
