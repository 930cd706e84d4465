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


def equinox_mlp():
    import equinox as eqx
    import jax

    return eqx.nn.MLP(64, 10, 32, 1, key=jax.random.key(0))


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


# Factories that bring their own data (the dict contract): the model, its batches, its loss.

def _tokens(batches, rows, length, vocab, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, (rows, length + 1)) for _ in range(batches)]


def hf_gpt2():
    """A Hugging Face GPT-2 (random weights, a small config), next-token batches as numpy
    arrays; the default loss reads the output's .logits."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    return {"model": model, "batches": [(t[:, :-1], t[:, 1:]) for t in _tokens(4, 8, 16, 96)]}


def timm_resnet():
    """A timm ResNet (random weights, a small config) on batches of 32x32 images, class targets:
    an input shape of its own (batch, 3, 32, 32) where digits' is (batch, 64)."""
    import importlib.util
    from pathlib import Path

    import numpy as np
    import torch

    # timm comes from where `make setup` puts it (tests/zoo_helper.py says why)
    spec = importlib.util.spec_from_file_location("zoo_helper", Path(__file__).parents[1] / "zoo_helper.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    timm = helper.import_timm()
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=10)
    rng = np.random.default_rng(0)
    return {"model": model, "batches": [(rng.normal(size=(8, 3, 32, 32)).astype("float32"),
                                         rng.integers(0, 10, 8)) for _ in range(3)]}


def keras_hub_classifier():
    """A keras-hub BERT text classifier (random weights, a small backbone) on dicts of token
    ids, segment ids and padding masks; class targets."""
    import keras
    import keras_hub
    import numpy as np

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=12, dropout=0.0)
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None, dropout=0.0)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(3):
        x = {"token_ids": rng.integers(0, 64, (8, 12)).astype("int32"),
             "segment_ids": np.zeros((8, 12), "int32"), "padding_mask": np.ones((8, 12), "bool")}
        batches.append((x, rng.integers(0, 3, 8).astype("int32")))
    return {"model": model, "batches": batches}


def nnx_regression(dtype=None, param_dtype=None):
    """A Flax NNX model with its own batches (a tuple of two inputs, passed positionally) and
    its own loss (mean squared error on float targets)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    class TwoInputs(nnx.Module):
        def __init__(self, rngs):
            kwargs = {"dtype": dtype, "param_dtype": param_dtype or jnp.float32, "rngs": rngs}
            self.a, self.b = nnx.Linear(6, 16, **kwargs), nnx.Linear(3, 16, **kwargs)
            self.out = nnx.Linear(16, 1, **kwargs)

        def __call__(self, x, z):
            return self.out(nnx.tanh(self.a(x) + self.b(z)))

    rng = np.random.default_rng(0)
    batches = [((rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 3)).astype("float32")),
                rng.normal(size=(16, 1)).astype("float32")) for _ in range(2)]
    return {"model": TwoInputs(nnx.Rngs(0)), "batches": batches,
            "loss": lambda out, y: jnp.mean((out.astype(jnp.float32) - y) ** 2)}


def dict_without_batches():
    import torch

    return {"model": torch.nn.Linear(4, 2)}


def dict_with_a_bad_pair():
    import torch

    return {"model": torch.nn.Linear(4, 2), "batches": [(1, 2, 3)]}


def dict_with_unknown_keys():
    import torch

    return {"model": torch.nn.Linear(4, 2), "batch": (None, None), "optimizer": "adam"}


def dict_whose_model_fails():
    import numpy as np
    import torch

    return {"model": torch.nn.Linear(4, 2), "batch": (np.zeros((2, 5), "float32"), np.zeros(2, "int64"))}
