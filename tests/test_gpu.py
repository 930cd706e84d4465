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


@pytest.mark.parametrize("policy", ["mixed_float16", "float32", "mixed_bfloat16", "bfloat16",
                                    "bfloat16_stochastic", "p=bf16,rounding=kahan"])
@pytest.mark.parametrize("fused", [True, None], ids=["fused", "torch's-choice"])
def test_every_policy_steps_without_a_host_sync_on_cuda(policy, fused):
    """The scaling step (the first builds the scale), the check that scales nothing (float32,
    bf16) and the update rules (stochastic rounding's hash, Kahan's compensation) stay on the
    device; an optimizer that left its implementation to torch takes the fused kernel, which
    skips on the device."""
    torch = _cuda()
    model = mp.apply_policy(_model(torch, "cuda"), policy)
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), fused=fused), policy=policy)
    x = torch.randn(8, 16, device="cuda")
    for step in range(2):
        opt.zero_grad()
        opt.scale_loss(model(x).float().pow(2).mean()).backward()
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not opt.last_step_skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_stochastic_rounding_on_cuda_is_one_compiled_kernel_with_the_cpus_bits(monkeypatch):
    """On CUDA a chunk's hash and rounding run as one kernel torch.compile writes; its result is
    the CPU's ops' bit for bit (integer arithmetic), across chunk boundaries, for a parameter
    larger than a chunk and for steps whose hash term wraps."""
    torch = _cuda()
    from mixedpolicy.backends.torch import rounding

    monkeypatch.setattr(rounding, "_CHUNK", 1000)
    sizes, indices = [700, 200, 2500, 1, 99], [0, 1, 2, 3, 7]
    x = torch.randn(sum(sizes))
    for step in (0, 123456789, 2**31 + 5):
        on_cpu, on_gpu = x.clone(), x.to("cuda")
        rounding.round_flat_(on_cpu, sizes, indices, step, "cpu")
        rounding.round_flat_(on_gpu, sizes, indices, step, "cuda")
        assert rounding._compiled() is not None and "cuda" in rounding._FUSED  # it took the kernel
        assert torch.equal(on_gpu.cpu(), on_cpu)


def test_all_finite_on_cuda_reads_every_dtype_without_a_host_sync():
    """mp.all_finite's one pass a group (the smallest and largest value) on CUDA tensors of
    each floating dtype: the flag stays on the device, and inf, -inf and NaN are each found."""
    torch = _cuda()
    tensors = [torch.ones(n, device="cuda", dtype=d) for n, d in
               ((300, torch.float32), (5, torch.bfloat16), (70, torch.float16), (0, torch.float32))]
    cases = [tensors]
    for bad in (float("inf"), float("-inf"), float("nan")):
        for i in range(3):
            poisoned = list(tensors)
            poisoned[i] = tensors[i].clone()
            poisoned[i][-1] = bad
            cases.append(poisoned)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flags = [mp.all_finite(case) for case in cases]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(f.is_cuda for f in flags)
    assert [bool(f) for f in flags] == [True] + [False] * 9


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


def test_jax_check_reads_large_arrays_through_the_gpus_matrix_kernels():
    """JAX's check reads an array of more than 4096 values by a matrix-vector product with zeros:
    on the GPU's kernels (and whatever XLA:GPU rewrites it into) an inf or NaN anywhere must still
    come out, jitted, in every float dtype; values at the top of the range stay finite."""
    jax = require_module("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("needs JAX with a GPU")
    jnp = jax.numpy
    from mixedpolicy.backends.jax.arrays import all_finite

    check = jax.jit(all_finite)
    tops = {jnp.float32: 3.0e38, jnp.bfloat16: 3.3e38, jnp.float16: 65504.0}
    leaves = [jnp.full((512, 384), top, dtype) for dtype, top in tops.items()] + [jnp.full((70001,), 1.0)]
    assert bool(check(leaves))
    for i, leaf in enumerate(leaves):
        for bad in (jnp.inf, -jnp.inf, jnp.nan):
            poisoned = list(leaves)
            poisoned[i] = leaf.ravel().at[12345].set(bad).reshape(leaf.shape)
            assert not bool(check(poisoned)), (i, bad)


@pytest.mark.parametrize("policy", ["float32", "bfloat16_stochastic"])
def test_optax_wrapper_keeps_its_one_state_array_on_the_device_under_nnx_jit(policy):
    """The one int32 state array (counters and the scale's bits) and the stochastic-rounding
    step stay on the GPU: no transfer after the first call."""
    jax = require_module("jax")
    optax = require_module("optax", "jax")
    nnx = require_module("flax.nnx", "jax")
    if jax.default_backend() != "gpu":
        pytest.skip("needs JAX with a GPU")
    model = mp.apply_policy(nnx.Linear(16, 4, rngs=nnx.Rngs(0)), policy)
    optimizer = nnx.Optimizer(model, mp.LossScaleOptimizer(optax.sgd(0.1), policy=policy), wrt=nnx.Param)
    x = jax.numpy.ones((8, 16))

    @nnx.jit
    def step(model, optimizer, x):
        grads = nnx.grad(lambda m: m(x).astype(jax.numpy.float32).mean())(model)
        optimizer.update(model, grads)

    step(model, optimizer, x)
    with jax.transfer_guard("disallow"):
        step(model, optimizer, x)
    assert np.isfinite(np.asarray(model.kernel[...], np.float32)).all()


def _fp8_net(torch, device, seed=0):
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 64),
                         nn.Linear(64, 16)).to(device)


def _fp8_losses(torch, net, steps=3, autocast=False, run=None):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=g).to("cuda")
    opt, losses = torch.optim.SGD(net.parameters(), lr=0.05), []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = (run or net)(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_on_cuda_equals_torchaos_own_conversion(recipe):
    """The same cuBLAS fp8 kernels in the same order as torchao's own set-up: bit for bit."""
    torch = _cuda()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matmuls need compute capability 8.9 (Ada, Hopper) or newer")
    require_module("torchao", "torch")
    from mixedpolicy.bench.runners.float8 import torchao_float8

    ours = mp.apply_policy(_fp8_net(torch, "cuda"), f"p=f32,c=bf16,float8={recipe}")
    fp8 = {row.path: row.float8 for row in mp.describe(ours)}
    assert (fp8["0"], fp8["3"], fp8["4"]) == (recipe, recipe, "-")  # the head kept out
    theirs = torchao_float8(_fp8_net(torch, "cuda"), recipe)
    assert _fp8_losses(torch, ours) == _fp8_losses(torch, theirs, autocast=True)


def test_fp8_compiled_on_cuda_trains_like_eager():
    torch = _cuda()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matmuls need compute capability 8.9 (Ada, Hopper) or newer")
    require_module("torchao", "torch")
    eager = _fp8_losses(torch, mp.apply_policy(_fp8_net(torch, "cuda"), "p=f32,c=bf16,float8=tensorwise"))
    net = mp.apply_policy(_fp8_net(torch, "cuda"), "p=f32,c=bf16,float8=tensorwise")
    compiled = _fp8_losses(torch, net, run=torch.compile(net))
    np.testing.assert_allclose(compiled, eager, rtol=2e-2)  # fused casts round differently
    assert compiled[-1] < compiled[0]


def test_delayed_fp8_on_cuda_runs_scaled_mm_and_matches_the_cpu_emulation():
    """Delayed scaling around torch._scaled_mm on the GPU's fp8 kernel: the same scales and
    histories as the CPU's emulated run of the same steps, within the kernels' rounding."""
    torch = _cuda()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matmuls need compute capability 8.9 (Ada, Hopper) or newer")
    policy = mp.Policy("float32", float8_recipe="delayed", amax_history_len=4)
    gpu = mp.apply_policy(_fp8_net(torch, "cuda"), policy)
    losses = _fp8_losses(torch, gpu, steps=4)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    cpu = mp.apply_policy(_fp8_net(torch, "cpu"), policy)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=g)
    opt = torch.optim.SGD(cpu.parameters(), lr=0.05)
    for _ in range(4):
        opt.zero_grad()
        cpu(x).float().pow(2).mean().backward()
        opt.step()
    for name, buf in gpu.state_dict().items():
        if "scale" in name or "history" in name:
            np.testing.assert_allclose(buf.cpu().numpy(), cpu.state_dict()[name].numpy(), rtol=2e-2, err_msg=name)


def test_the_float8_sweep_runs_on_cuda():
    torch = _cuda()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matmuls need compute capability 8.9 (Ada, Hopper) or newer")
    require_module("torchao", "torch")
    from mixedpolicy.bench import float8_sweep

    row = float8_sweep.measure(256, 1, "tensorwise", "cuda", compile_on=False, repeats=3, warmup=1,
                               min_block_time=0.005)
    assert row["first_loss"]["fp8"] == row["first_loss"]["torchao"]
    assert row["fp8 / bf16"]["median"] > 0 and row["fp8 / torchao"]["median"] > 0
    assert set(row["gpu_ms"]) == {"bf16", "fp8", "torchao"} and min(row["gpu_ms"].values()) > 0
    one = float8_sweep.measure_linear(256, 512, "tensorwise", "cuda", compile_on=True, repeats=2, warmup=1,
                                      min_block_time=0.005, tokens=256)
    assert set(one["gpu_ms"]) == {"bf16", "fp8"} and one["fp8 / bf16 (gpu time)"] > 0
