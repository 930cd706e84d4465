"""Users' models for ``mixedpolicy bench --model tests/bench/user_models.py:FACTORY``, written
to the documented factory contract (docs/benchmarks.md): a callable of no arguments that
returns a fresh model taking digits' 64 float32 features to 10 logits; a Flax NNX factory
also takes Flax's ``dtype`` and ``param_dtype``. Each imports its framework when called."""


def torch_mlp():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def nnx_mlp(dtype=None, param_dtype=None):
    import jax.numpy as jnp
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            kwargs = {"dtype": dtype, "param_dtype": param_dtype or jnp.float32, "rngs": rngs}
            self.hidden = nnx.Linear(64, 32, **kwargs)
            self.norm = nnx.LayerNorm(32, **kwargs)
            self.out = nnx.Linear(32, 10, **kwargs)

        def __call__(self, x):
            return self.out(nnx.relu(self.norm(self.hidden(x))))

    return MLP(nnx.Rngs(0))


def nnx_without_dtype():
    from flax import nnx

    return nnx.Linear(64, 10, rngs=nnx.Rngs(0))


def linen_mlp():
    from flax import linen

    return linen.Dense(10)


def keras_mlp():
    import keras

    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.LayerNormalization(), keras.layers.Dense(10)])


def torch_wrong_width():
    import torch

    return torch.nn.Linear(32, 10)


def torch_seven_classes():
    import torch

    return torch.nn.Linear(64, 7)


def raises():
    raise RuntimeError("no GPU here")


def not_a_model():
    return 42
