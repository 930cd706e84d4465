"""Overhead of mixedpolicy under jax.jit against the same step written by hand, jmp-style.

Ours: ``mp.apply_policy(mlp, policy)`` and ``mp.LossScaleOptimizer(optax.sgd(...))``.
By hand: jmp's policy casts, and under ``mixed_float16`` jmp's ``DynamicLossScale``
with ``all_finite`` / ``select_tree`` around the optax update (as jmp's README
shows); other policies need no loss scale, so neither step has one. Both steps run in one
process, interleaved (ours, native, native, ours, ...), each timed over `--steps`
jitted steps after compilation; the figure is the median of `--repeats` ratios. On
CPUs without bf16/fp16 hardware half precision is slower than float32: the ratio,
not the absolute time, is what measures mixedpolicy.

    python benchmarks/jax_overhead.py [--repeats 9]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from _interleave import HEADER, interleave

import mixedpolicy as mp


def mlp(params, x):
    for i, (w, b) in enumerate(params):
        x = x @ w + b
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


def model_and_data(width, batch, seed=0):
    rng = np.random.default_rng(seed)
    sizes = [64, width, width, 10]
    params = [(jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32), jnp.zeros(b, jnp.float32))
              for a, b in zip(sizes[:-1], sizes[1:])]
    x = jnp.asarray(rng.normal(size=(batch, 64)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, batch), jnp.int32)
    return params, x, y


def cross_entropy(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def plain_sgd(loss, params):
    """A jitted SGD step on `loss(params)` with no loss scale, and its first carry."""
    tx = optax.sgd(1e-3)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state
    return step, (params, tx.init(params))


def ours(policy, width, batch):
    params, x, y = model_and_data(width, batch)
    model = mp.apply_policy(mlp, policy)
    if not mp.Policy(policy).needs_loss_scaling:  # only float16 needs a loss scale
        return plain_sgd(lambda p: cross_entropy(model(p, x), y), params)
    opt = mp.LossScaleOptimizer(optax.sgd(1e-3))
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: opt.scale_loss(cross_entropy(model(p, x), y), state))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step, (params, state)


def native(policy, width, batch):
    params, x, y = model_and_data(width, batch)
    p = mp.Policy(policy).to_jmp()
    logits = lambda params: p.cast_to_output(mlp(p.cast_to_compute(params), p.cast_to_compute(x)))  # noqa: E731
    if not mp.Policy(policy).needs_loss_scaling:
        return plain_sgd(lambda params: cross_entropy(logits(params), y), params)
    tx = optax.sgd(1e-3)
    # The scale's arrays are carried, not the jmp object: unflattening one runs a
    # jax.eval_shape check on every call, a host cost a careful hand-written loop avoids.
    @jax.jit
    def step(params, carry):
        opt_state, loss_scale, counter = carry
        scale = jmp.DynamicLossScale(loss_scale, counter)

        grads = scale.unscale(jax.grad(lambda q: scale.scale(cross_entropy(logits(q), y)))(params))
        finite = jmp.all_finite(grads)
        updates, new_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(finite, (new_params, new_state), (params, opt_state))
        scale = scale.adjust(finite)
        return params, (opt_state, scale.loss_scale, scale.counter)
    return step, (params, (tx.init(params), jnp.asarray(2.0**15, jnp.float32), jnp.zeros((), jnp.int32)))


class Runner:
    """A jitted step and its carried state: ``run(n)`` takes n steps and waits for them."""

    def __init__(self, step, carry):
        self.step, self.carry = step, carry

    def run(self, steps):
        start = time.perf_counter()
        carry = self.carry
        for _ in range(steps):
            carry = self.step(*carry)
        jax.block_until_ready(carry)
        self.carry = carry
        return (time.perf_counter() - start) / steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="float32,mixed_bfloat16,mixed_float16")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}, model MLP 64-{args.width}-"
          f"{args.width}-10, batch {args.batch}, {args.steps} steps x {args.repeats} repeats, interleaved")
    print(f"{'policy':16s} {HEADER}")
    results = {}
    for policy in args.policies.split(","):
        a, b = Runner(*ours(policy, args.width, args.batch)), Runner(*native(policy, args.width, args.batch))
        a.run(3), b.run(3)  # compile and warm up
        comparison = interleave(lambda: a.run(args.steps), lambda: b.run(args.steps), args.repeats)
        results[policy] = comparison.ratio
        print(comparison.row(f"{policy:16s}"))
    return results


if __name__ == "__main__":
    main()
