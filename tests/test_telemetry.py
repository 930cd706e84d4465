"""Loss-scale telemetry: mp.metrics, the Lightning-style callback, the mixedpolicy logger."""

import logging

import pytest

import mixedpolicy as mp
from conftest import require_module


def test_metrics_of_a_torch_optimizer_and_an_optax_state():
    torch = require_module("torch")
    model = torch.nn.Linear(2, 2)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy="mixed_float16")
    opt.scale_loss(model(torch.ones(1, 2)).sum().mul(float("inf"))).backward()
    opt.step()
    assert mp.metrics(opt) == {"loss_scale": 16384.0, "skipped_steps": 1, "last_step_skipped": True}
    assert set(mp.metrics(opt, prefix="train/")) == {"train/loss_scale", "train/skipped_steps",
                                                     "train/last_step_skipped"}
    jnp = require_module("jax").numpy
    optax = require_module("optax", "jax")
    tx = mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_float16")
    state = tx.init({"w": jnp.ones(2)})
    assert mp.metrics(state) == {"loss_scale": 32768.0, "skipped_steps": 0, "last_step_skipped": False}
    # the wrapper's state inside a chain's or MultiSteps' state is found where it sits
    for outer in (optax.chain(optax.clip_by_global_norm(1.0), tx), optax.MultiSteps(tx, 2)):
        assert mp.metrics(outer.init({"w": jnp.ones(2)}))["loss_scale"] == 32768.0
    with pytest.raises(TypeError, match="or a state holding one"):
        mp.metrics(optax.sgd(0.1).init({"w": jnp.ones(2)}))
    with pytest.raises(TypeError, match="expected a mixedpolicy LossScaleOptimizer"):
        mp.metrics(torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_lightning_style_callback_logs_every_n_steps():
    torch = require_module("torch")
    model = torch.nn.Linear(2, 2)
    ours = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy="mixed_float16")
    logged = []
    trainer = type("Trainer", (), {"optimizers": [ours, torch.optim.SGD(model.parameters(), lr=0.1)]})()
    module = type("Module", (), {"log_dict": lambda self, values: logged.append(values)})()
    callback = mp.LightningLossScaleCallback(every_n_steps=2)
    for i in range(5):
        callback.on_train_batch_end(trainer, module, None, None, i)
    assert len(logged) == 3 and logged[0] == {"loss_scale/0/loss_scale": 32768.0,
                                              "loss_scale/0/skipped_steps": 0.0,
                                              "loss_scale/0/last_step_skipped": 0.0}
    with pytest.raises(ValueError, match="every_n_steps=0"):
        mp.LightningLossScaleCallback(0)


def test_the_factory_says_what_it_chose_through_the_mixedpolicy_logger(caplog):
    torch = require_module("torch")
    with caplog.at_level(logging.INFO, logger="mixedpolicy"):
        mp.LossScaleOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), policy="mixed_bfloat16")
    assert ("LossScaleOptimizer(SGD): no scaling; a step whose gradients are not all finite is skipped, "
            "following the policy") in caplog.text


def test_a_missing_framework_names_its_extra(monkeypatch):
    import sys

    if "jax" in vars(mp):  # set by an earlier import of mixedpolicy.jax
        monkeypatch.delattr(mp, "jax")
    monkeypatch.setitem(sys.modules, "jax", None)  # as if JAX were not installed
    monkeypatch.delitem(sys.modules, "mixedpolicy.jax", raising=False)
    monkeypatch.delitem(sys.modules, "mixedpolicy.backends.jax.reduce", raising=False)
    with pytest.raises(ImportError, match=r"mp.jax needs jax, which is not installed; install it with "
                                          r"pip install \"mixedpolicy\[jax\]\""):
        mp.jax
