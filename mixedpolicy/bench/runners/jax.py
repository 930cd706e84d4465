"""JAX (Flax NNX): mixedpolicy against Flax's own dtype arguments and jmp-style loss scaling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mixedpolicy as mp
from mixedpolicy.bench.models import (BN_EPSILON, BN_MOMENTUM, LN_EPSILON, MOMENTUM, learning_rate,
                                      resnet_blocks, stem_stride)
from mixedpolicy.bench import user_model
from mixedpolicy.bench.recipes import model_part
from mixedpolicy.bench.runners import nnx_steps, nnx_user
from mixedpolicy.bench.runners.float8 import nnx_tensorwise
from mixedpolicy.bench.trainer import Trainer, memory, pin_tf32
from mixedpolicy.bench.user_model import UserSetup

_COMPUTE, _PURE = nnx_user.COMPUTE, nnx_user.PURE
_NORMS = (nnx.LayerNorm, nnx.BatchNorm, nnx.GroupNorm, nnx.RMSNorm)


_RNGS = nnx.Rngs(0)  # its keys are ignored by the initialisers below, which hand out the shared weights


def _given(value: np.ndarray):
    """An initialiser that returns `value`: no random init to compute (and compile) first."""
    def init(key, shape, dtype=jnp.float32):
        if tuple(shape) != value.shape:
            raise ValueError(f"The shared weights hold shape {value.shape} where the layer "
                             f"asks for {tuple(shape)}: the weights file and the model config disagree.")
        return jnp.asarray(value, dtype)
    return init


def _linear(w: dict, name: str, dtype) -> nnx.Linear:
    kernel = w[f"{name}.kernel"]
    return nnx.Linear(*kernel.shape, dtype=dtype, kernel_init=_given(kernel),
                      bias_init=_given(w[f"{name}.bias"]), rngs=_RNGS)


def _conv(w: dict, name: str, dtype, stride: int = 1) -> nnx.Conv:
    kernel = w[f"{name}.kernel"]  # (h, w, in, out), as Flax keeps it
    size, _, n_in, n_out = kernel.shape
    pad = size // 2  # PyTorch's symmetric padding ("SAME" pads 0/1 when striding by 2)
    bias = w.get(f"{name}.bias")
    return nnx.Conv(n_in, n_out, (size, size), strides=stride, padding=((pad, pad), (pad, pad)),
                    use_bias=bias is not None, dtype=dtype, kernel_init=_given(kernel),
                    bias_init=_given(bias) if bias is not None else nnx.initializers.zeros, rngs=_RNGS)


def _norm(w: dict, name: str, dtype, batch: bool):
    n = len(w[f"{name}.scale"])
    inits = {"scale_init": _given(w[f"{name}.scale"]), "bias_init": _given(w[f"{name}.bias"])}
    if batch:
        norm = nnx.BatchNorm(n, momentum=BN_MOMENTUM, epsilon=BN_EPSILON, dtype=dtype, rngs=_RNGS, **inits)
        norm.mean.set_value(jnp.asarray(w[f"{name}.mean"]))
        norm.var.set_value(jnp.asarray(w[f"{name}.var"]))
        return norm
    return nnx.LayerNorm(n, epsilon=LN_EPSILON, dtype=dtype, rngs=_RNGS, **inits)


# `dtype` is the compute dtype of the hand-written version (None: ours, set by apply_policy);
# `norm_dtype` keeps its norm layers in float32, as mixedpolicy's built-in rule does.

class MLP(nnx.Module):
    def __init__(self, w: dict, cfg: dict, dtype=None, norm_dtype=None):
        self.layers = nnx.List([_linear(w, f"dense{i}", dtype) for i in range(len(cfg["sizes"]) - 1)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


class CNN(nnx.Module):
    def __init__(self, w: dict, cfg: dict, dtype=None, norm_dtype=None):
        self.conv1, self.conv2 = _conv(w, "conv1", dtype), _conv(w, "conv2", dtype)
        self.head = _linear(w, "head", dtype)

    def __call__(self, x):
        x = jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(x))))
        x = nnx.max_pool(x, (2, 2), strides=(2, 2))
        return self.head(x.reshape(x.shape[0], -1))


class Attention(nnx.Module):
    """Multi-head self-attention, the logits and the weighted sum in the compute dtype and the
    softmax in float32 (Flax's and jax.nn's attention ask XLA for float16 x float16 -> float32
    dots, which its CPU backend does not have)."""

    def __init__(self, w: dict, name: str, heads: int, dtype=None, causal: bool = False):
        self.heads, self.causal = heads, causal
        self.q, self.k, self.v, self.o = (_linear(w, f"{name}.{p}", dtype) for p in "qkvo")

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = (dense(x).reshape(b, t, self.heads, d // self.heads) for dense in (self.q, self.k, self.v))
        logits = (jnp.einsum("bqnh,bknh->bnqk", q, k) / jnp.sqrt(d // self.heads).astype(q.dtype)).astype(jnp.float32)
        if self.causal:  # a token sees itself and those before it
            logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
        weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return self.o(jnp.einsum("bnqk,bknh->bqnh", weights, v).reshape(b, t, d))


class EncoderBlock(nnx.Module):
    def __init__(self, w: dict, name: str, cfg: dict, dtype=None, norm_dtype=None, causal: bool = False):
        self.ln1, self.ln2 = _norm(w, f"{name}.ln1", norm_dtype, False), _norm(w, f"{name}.ln2", norm_dtype, False)
        self.attn = Attention(w, name, cfg["heads"], dtype, causal)
        self.mlp1, self.mlp2 = _linear(w, f"{name}.mlp1", dtype), _linear(w, f"{name}.mlp2", dtype)

    def __call__(self, x):
        # Residual sums in the stream's dtype (explicit casts: strict dtype promotion holds).
        x = x + self.attn(self.ln1(x)).astype(x.dtype)
        return x + self.mlp2(jax.nn.gelu(self.mlp1(self.ln2(x)), approximate=False)).astype(x.dtype)


class Transformer(nnx.Module):
    def __init__(self, w: dict, cfg: dict, dtype=None, norm_dtype=None):
        self.embed = _linear(w, "embed", dtype)
        self.pos = nnx.Param(jnp.asarray(w["pos"]))
        self.blocks = nnx.List([EncoderBlock(w, f"block{i}", cfg, dtype, norm_dtype)
                                for i in range(cfg["blocks"])])
        self.ln = _norm(w, "ln", norm_dtype, False)
        self.head = _linear(w, "head", dtype)

    def __call__(self, x):
        h = self.embed(x).astype(self.pos.dtype) + self.pos[...]  # a float32 stream, as in PyTorch
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h).mean(1))


class Decoder(nnx.Module):
    """gpt2: token embedding plus positions, causal blocks, logits for every token."""

    def __init__(self, w: dict, cfg: dict, dtype=None, norm_dtype=None):
        table = w["tok.embedding"]
        self.tok = nnx.Embed(*table.shape, dtype=dtype, embedding_init=_given(table), rngs=_RNGS)
        self.pos = nnx.Param(jnp.asarray(w["pos"]))
        self.blocks = nnx.List([EncoderBlock(w, f"block{i}", cfg, dtype, norm_dtype, causal=True)
                                for i in range(cfg["blocks"])])
        self.ln = _norm(w, "ln", norm_dtype, False)
        self.head = _linear(w, "head", dtype)

    def __call__(self, x):
        h = self.tok(x).astype(self.pos.dtype) + self.pos[:x.shape[1]]  # a float32 stream
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


class Block(nnx.Module):
    """A basic block (two 3x3 convolutions), or a bottleneck one (1x1, 3x3 with the stride,
    1x1) where the weights have a third convolution."""

    def __init__(self, w: dict, name: str, stride: int, dtype=None, norm_dtype=None):
        bottleneck = f"{name}.conv3.kernel" in w
        strides = (1, stride, 1) if bottleneck else (stride, 1)
        self.convs = nnx.List([_conv(w, f"{name}.conv{i + 1}", dtype, s) for i, s in enumerate(strides)])
        self.bns = nnx.List([_norm(w, f"{name}.bn{i + 1}", norm_dtype, True) for i in range(len(strides))])
        has_proj = f"{name}.proj.kernel" in w
        self.proj = _conv(w, f"{name}.proj", dtype, stride) if has_proj else None
        self.proj_bn = _norm(w, f"{name}.proj_bn", norm_dtype, True) if has_proj else None

    def __call__(self, x):
        out = x
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            out = bn(conv(out))
            out = jax.nn.relu(out) if i < len(self.convs) - 1 else out
        short = x if self.proj is None else self.proj_bn(self.proj(x))
        return jax.nn.relu(out + short.astype(out.dtype))


class ResNet(nnx.Module):
    def __init__(self, w: dict, cfg: dict, dtype=None, norm_dtype=None):
        self.stem = _conv(w, "stem", dtype, stem_stride(cfg))
        self.stem_bn = _norm(w, "stem_bn", norm_dtype, True)
        self.pool = cfg.get("stem") == "imagenet"
        self.blocks = nnx.List([Block(w, name, stride, dtype, norm_dtype)
                                for name, _, _, stride in resnet_blocks(cfg)])
        self.head = _linear(w, "head", dtype)

    def __call__(self, x):
        x = jax.nn.relu(self.stem_bn(self.stem(x)))
        if self.pool:  # 3x3, stride 2, padding 1 (padded with -inf, as PyTorch pads)
            x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((1, 2)))


_MODELS = {"mlp": MLP, "cnn": CNN, "transformer": Transformer, "resnet": ResNet, "resnet50": ResNet,
           "gpt2": Decoder}


def _loss(model, x, y):
    return nnx_steps.cross_entropy(model(x), y)


class _Nnx(Trainer):
    def __init__(self, model, setup: UserSetup | None = None):
        self.model = model
        self._loss = None
        self.steps_of = nnx_steps.steps(setup.loss) if setup and setup.loss else nnx_steps.steps()
        self.user_batches = setup.batches if setup else None  # a user's own data, or None: digits

    def sync(self) -> None:
        jax.block_until_ready(self._loss)

    def last_loss(self) -> float:
        return float(self._loss)

    def memory(self) -> dict:
        def pairs(tree):
            return [(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(tree) if hasattr(a, "dtype")]
        return memory(pairs(nnx.state(self.model, nnx.Param)), pairs(nnx.state(self.model)),
                      pairs(nnx.state(self.optimizer)) + pairs((getattr(self, "scale", None), getattr(self, "counter", None))))

    def predict(self, x) -> np.ndarray:
        self.model.eval()
        logits = np.asarray(self.steps_of.predict(self.model, user_model.tree_map(jnp.asarray, x)), np.float32)
        self.model.train()
        return logits


class Ours(_Nnx):
    def __init__(self, net: nnx.Module, policy: str, lr: float, setup: UserSetup | None = None):
        super().__init__(mp.apply_policy(net, policy), setup)
        sgd = optax.sgd(lr, momentum=MOMENTUM)
        # one training loop for every policy: a pass-through where the policy needs no scaling
        self.optimizer = nnx.Optimizer(self.model, mp.LossScaleOptimizer(sgd, policy=policy), wrt=nnx.Param)
        self._scaled = mp.Policy(policy).needs_loss_scaling
        self._step = nnx.cached_partial(self.steps_of.ours, self.model, self.optimizer)

    def step(self, x, y) -> None:
        self._loss = self._step(x, y)

    def skipped_steps(self) -> int:
        state = self.optimizer.opt_state
        return int(state.num_skipped_steps) if hasattr(state, "num_skipped_steps") else 0

    def loss_scale(self):
        state = self.optimizer.opt_state
        return float(state.loss_scale) if self._scaled else None


class Native(_Nnx):
    """Flax's own dtype arguments (the compute dtype; a pure policy's parameters in the half
    dtype too, norm layers' kept float32), jmp-style dynamic loss scaling where float16
    computes."""

    def __init__(self, net: nnx.Module, policy: str, lr: float, setup: UserSetup | None = None):
        fp8, policy = mp.Policy(policy).float8_recipe, mp.Policy(policy).source.name
        super().__init__(net if fp8 is None else nnx_tensorwise(net), setup)
        self.optimizer = nnx.Optimizer(self.model, optax.sgd(lr, momentum=MOMENTUM), wrt=nnx.Param)
        self.scaled = mp.Policy(policy).needs_loss_scaling
        self.scale, self.counter = jnp.asarray(2.0**15, jnp.float32), jnp.zeros((), jnp.int32)
        step = self.steps_of.native if self.scaled else self.steps_of.plain
        self._step = nnx.cached_partial(step, self.model, self.optimizer)
        dtype = jnp.dtype(_COMPUTE[policy]).name
        self.recipe = ("float32" if policy == "float32" else
                       f"Flax dtype={dtype}" + (f", param_dtype={dtype}" if policy in _PURE else "")
                       + (", jmp-style dynamic loss scale" if self.scaled else "")
                       + (", a hand-written float8 tensorwise dot_general but the head" if fp8 else ""))

    def step(self, x, y) -> None:
        if self.scaled:
            self._loss, self.scale, self.counter = self._step(x, y, self.scale, self.counter)
        else:
            self._loss = self._step(x, y)


def _cast_params(net: nnx.Module, dtype) -> nnx.Module:
    """Every parameter outside the norm layers in `dtype`: what Flax's ``param_dtype`` makes,
    set after the build (the built-in models take the compute dtype alone)."""
    for _, node in nnx.iter_graph(net):
        if isinstance(node, nnx.Module) and not isinstance(node, _NORMS):
            for value in vars(node).values():
                if isinstance(value, nnx.Param):
                    value.set_value(value.get_value().astype(dtype))
    return net


def _built_in(model: str, cfg: dict, weights: dict, policy: str) -> tuple[nnx.Module, nnx.Module]:
    ours = _MODELS[model](weights, cfg)
    native = _MODELS[model](weights, cfg, dtype=_COMPUTE[policy], norm_dtype=jnp.float32)
    return ours, _cast_params(native, _COMPUTE[policy]) if policy in _PURE else native


def trainers(model: str, cfg: dict, policy: str, weights: dict, device: str, compile: bool = False,
             tf32: bool = False):
    """(ours, native); both steps are always compiled (nnx.jit), whatever `compile` says."""
    pin_tf32("jax", device, tf32)
    base = model_part(policy)  # an update recipe is ours alone: the models and Flax's side run its base
    source = mp.Policy(base).source.name  # fp8: the models are built in its source precision
    if ":" in model:
        setup, native = nnx_user.build(model, source)
        return (Ours(setup.model, policy, learning_rate(model), setup),
                Native(native, base, learning_rate(model), setup))
    ours, native = _built_in(model, cfg, weights, source)
    return Ours(ours, policy, learning_rate(model)), Native(native, base, learning_rate(model))


def network(model: str, cfg: dict, weights: dict, device: str) -> nnx.Module:
    """The bench model in float32, no policy (what `mixedpolicy inspect` looks at)."""
    return nnx_user.build(model, "float32")[0].model if ":" in model else _MODELS[model](weights, cfg)


def loss(net: nnx.Module, x: np.ndarray, y: np.ndarray):
    return _loss(net, jnp.asarray(x), jnp.asarray(y))


def user_loss(setup: UserSetup, net: nnx.Module, batch: tuple):
    """The loss of `net` (a user's model) on one of its own (inputs, targets) batches."""
    x, y = batch
    return (setup.loss or nnx_steps.cross_entropy)(user_model.call(net, user_model.tree_map(jnp.asarray, x)), y)


def check_user(setup: UserSetup) -> float:
    """The loss of a user's model on its first batch: what the bench checks before any run."""
    return float(user_loss(setup, setup.model, setup.batches[0]))
