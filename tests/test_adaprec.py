"""AdaPrec: speculative choice of the reduce precision (digits MLP, JAX, one host device)."""

import numpy as np
import pytest

from conftest import require_module

import mixedpolicy as mp
from mixedpolicy.adaprec import AdaPrec, parse_bandwidth, predict_loss


def test_bandwidths_and_the_learning_curve_model():
    assert parse_bandwidth("14GiB/s") == 14 * 2**30 and parse_bandwidth("100 Gbit/s") == 100e9 / 8
    assert parse_bandwidth(1e6) == 1e6
    for bad in ("fast", "0 GB/s", "-1MB/s", float("inf")):
        with pytest.raises(ValueError, match="bandwidth"):
            parse_bandwidth(bad)
    with pytest.raises(TypeError, match="bandwidth=None"):
        parse_bandwidth(None)
    curve = [2.0 - 0.3 * np.log(k) for k in range(1, 6)]
    assert predict_loss(curve, at=50) == pytest.approx(2.0 - 0.3 * np.log(50))
    assert 0.9 < predict_loss([1.0, 1.1, 1.2], at=50) <= 1.0  # a rising curve is not extrapolated up
    assert predict_loss([1.0, float("nan")], at=5) == float("inf")  # a diverged candidate loses


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="no candidates"):
        AdaPrec([], bytes_per_step=len)
    with pytest.raises(ValueError, match="speculative_steps=0"):
        AdaPrec(["float32"], speculative_steps=0, bytes_per_step=len)
    with pytest.raises(ValueError, match="speculative_steps=9 > interval=4"):
        AdaPrec(["float32"], speculative_steps=9, interval=4, bytes_per_step=len)
    with pytest.raises(ValueError, match="compute_seconds=-1"):
        AdaPrec(["float32"], compute_seconds=-1, bytes_per_step=len)


def _digits_setup():
    jax = require_module("jax")
    optax = require_module("optax", "jax")
    jnp = jax.numpy
    from jax.sharding import Mesh, PartitionSpec as P
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    mesh = Mesh(np.array(jax.devices()[:1]), ("r",))
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"hidden": {"w": jax.random.normal(k1, (64, 64)) * 0.1, "b": jnp.zeros(64)},
              "head": {"w": jax.random.normal(k2, (64, 10)) * 0.1, "b": jnp.zeros(10)}}
    tx = optax.sgd(0.1, momentum=0.9)
    steps = {}

    def step_for(reduce_dtype):
        if reduce_dtype not in steps:
            policy = mp.Policy("float32", reduce_dtype=reduce_dtype)

            def local(p, s, xb, yb):
                def loss_fn(q):
                    h = jax.nn.relu(xb @ q["hidden"]["w"] + q["hidden"]["b"])
                    return optax.softmax_cross_entropy_with_integer_labels(h @ q["head"]["w"] + q["head"]["b"], yb).mean()
                loss, g = jax.value_and_grad(loss_fn)(p)
                updates, s = tx.update(mp.jax.all_reduce(g, "r", policy), s, p)
                return optax.apply_updates(p, updates), s, jax.lax.pmean(loss, "r")
            steps[reduce_dtype] = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("r"), P("r")),
                                                        out_specs=(P(), P(), P())))
        return steps[reduce_dtype]

    def train_step(state, batch, reduce_dtype):
        p, s = state
        p, s, loss = step_for(reduce_dtype)(p, s, x[batch], y[batch])
        return (p, s), loss

    rng = np.random.default_rng(0)
    batches = [rng.choice(len(x), 64, replace=False) for _ in range(40)]
    return jax, (params, tx.init(params)), batches, train_step, params


def test_speculation_restores_the_state_bit_for_bit_and_decisions_repeat():
    jax, state, batches, train_step, params = _digits_setup()
    plain = state
    for batch in batches:
        plain, _ = train_step(plain, batch, "float32")
    only = AdaPrec(["float32"], speculative_steps=3, interval=10, bytes_per_step=lambda c: 4,
                   compute_seconds=1e-3)
    for _, ours, _, _ in only.run(state, batches, train_step):
        pass
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [d.step for d in only.decisions] == [0, 10, 20, 30]

    def bytes_of(c):
        return mp.jax.bytes_per_step(params, mp.Policy("float32", reduce_dtype=c))

    def decisions(bandwidth):
        ada = AdaPrec(["float32", "float8_e5m2", "table-1"], speculative_steps=4, interval=10,
                      bytes_per_step=bytes_of, bandwidth=bandwidth, compute_seconds=1e-4)
        out = [(loss, choice) for _, _, loss, choice in ada.run(state, batches, train_step)]
        return ada, [loss for loss, _ in out], [choice for _, choice in out]

    slow, losses, choices = decisions("1MB/s")
    again, _, _ = decisions("1MB/s")
    assert [d.choice for d in slow.decisions] == [d.choice for d in again.decisions]  # deterministic
    # on a slow link the fewest bytes that still learn win (float32 only where a cheap codec
    # was rolled back); the loss falls all the same
    assert slow.decisions[0].choice in ("float8_e5m2", "table-1")
    assert sum(map(bytes_of, choices)) < 0.5 * len(choices) * bytes_of("float32")
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    fast, _, _ = decisions("1TB/s")  # bytes cost nothing: the best predicted loss wins
    first = fast.decisions[0]
    assert first.choice == min(first.predicted, key=first.predicted.get)
    assert set(first.scores) == {"float32", "float8_e5m2", "table-1"}


def test_a_choice_that_makes_the_loss_climb_is_rolled_back_and_not_taken_again():
    # a toy: "wild" falls fastest for a few steps, then climbs; "steady" falls slowly
    def train_step(state, batch, choice):
        loss, age = state
        if choice == "wild":
            age += 1
            loss = loss * 0.7 if age <= 6 else loss * 3.0
        else:
            age, loss = 0, loss * 0.95
        return (loss, age), loss

    ada = AdaPrec(["steady", "wild"], speculative_steps=3, interval=10, bytes_per_step=lambda c: 0,
                  compute_seconds=1.0, min_relative_gain=0.0)
    out = list(ada.run((1.0, 0), range(40), train_step))
    # seen climbing at the first check after it does (every 3 steps), not at the next decision
    assert ada.decisions[0].choice == "wild" and ada.rollbacks == [(9, "wild")] and ada.banned == ["wild"]
    assert ada.decisions[1].step == 9 and all(d.choice == "steady" and "wild" not in d.scores
                                              for d in ada.decisions[1:])
    assert out[-1][2] < 1.0  # the run still learns
    with pytest.raises(ValueError, match="divergence=1"):
        AdaPrec(["a"], divergence=1, bytes_per_step=len)
