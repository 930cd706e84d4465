"""Checks only a CUDA GPU can make (marked `gpu`; `make test-gpu` runs them, and they skip here
without one). Each runs the same code on the CPU in the main suite where the CPU allows it.
"""

import numpy as np
import pytest

from conftest import require_module

import mixedpolicy as mp


@pytest.fixture(autouse=True)
def _where_loss_scaling_is_on():
    """These tests are about scaling: they run under a float16 global policy, where
    LossScaleOptimizer(opt) scales (tests/test_loss_scale_follows_policy.py: the rest)."""
    mp.set_global_policy("mixed_float16")  # the root conftest restores it

pytestmark = pytest.mark.gpu


def _cuda():
    torch = require_module("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch


def _model(torch, device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4)).to(device)


def test_fused_optimizer_steps_without_a_host_sync_on_cuda():
    torch = _cuda()
    model = mp.apply_policy(_model(torch, "cuda"), "mixed_float16")
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), fused=True))
    x = torch.randn(8, 16, device="cuda")
    opt.scale_loss(model(x).float().pow(2).mean()).backward()
    opt.step()  # the first step builds the scale
    opt.zero_grad()
    opt.scale_loss(model(x).float().pow(2).mean()).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not opt.last_step_skipped


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_gradscaler_state_moves_both_ways(device):
    torch = require_module("torch")
    if device == "cuda":
        _cuda()
    model = _model(torch, device)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                initial_scale=2.0**10, dynamic_growth_steps=3)
    opt.scale_loss(model(torch.randn(4, 16, device=device)).sum()).backward()
    opt.step()
    scaler = torch.amp.GradScaler(device)
    scaler.load_state_dict(opt.scaler_state_dict())
    assert scaler.get_scale() == 2.0**10 and scaler.state_dict()["_growth_tracker"] == 1
    back = mp.LossScaleOptimizer(torch.optim.SGD(_model(torch, device).parameters(), lr=0.1))
    back.load_scaler_state_dict(scaler.state_dict())
    assert float(back.loss_scale) == 2.0**10 and back.loss_scale.device.type == device


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("policy, half", [("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")])
def test_autocast_dtypes_per_layer(device, policy, half):
    torch = require_module("torch")
    if device == "cuda":
        _cuda()
    model = mp.apply_policy(_model(torch, device), policy, {"3": "float32"})
    seen = {}
    for name, layer in model.named_children():
        layer.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o.dtype))
    x = torch.randn(4, 16, device=device)
    out = model(x)
    by_hand, native = _model(torch, device), {}
    by_hand[1].register_forward_hook(lambda m, i, o: native.__setitem__("1", o.dtype))
    with torch.autocast(device, dtype=getattr(torch, half)):
        by_hand(x)
    assert seen["0"] == getattr(torch, half)       # matmul in half precision
    assert seen["1"] == native["1"]                # the norm as hand-written autocast has it
    assert seen["3"] == out.dtype == torch.float32  # the float32 override
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_jax_on_gpu_keeps_the_step_on_the_device():
    jax = require_module("jax")
    optax = require_module("optax", "jax")
    if jax.default_backend() != "gpu":
        pytest.skip("needs JAX with a GPU")
    jnp = jax.numpy
    opt = mp.LossScaleOptimizer(optax.sgd(0.1))
    params = {"w": jnp.ones((16, 4), jnp.float32)}
    state = opt.init(params)

    @jax.jit
    def step(params, state, x):
        grads = jax.grad(lambda p: opt.scale_loss((x @ p["w"].astype(jnp.float16)).astype(jnp.float32).mean(), state))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x = jnp.ones((8, 16), jnp.float16)
    params, state = step(params, state, x)
    with jax.transfer_guard("disallow"):
        params, state = step(params, state, x)
    assert not bool(state.last_step_skipped)
    assert np.isfinite(np.asarray(params["w"])).all()
