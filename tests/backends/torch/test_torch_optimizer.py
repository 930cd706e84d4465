"""PyTorch LossScaleOptimizer: GradScaler parity, skipping, clipping, accumulation, checkpoints, DDP."""

import contextlib
import copy

import numpy as np
import pytest

from conftest import require_module

torch = require_module("torch")
import mixedpolicy as mp  # noqa: E402


@pytest.fixture(autouse=True)
def _where_loss_scaling_is_on():
    """These tests are about scaling: they run under a float16 global policy, where
    LossScaleOptimizer(opt) scales (tests/test_loss_scale_follows_policy.py: the rest)."""
    mp.set_global_policy("mixed_float16")  # the root conftest restores it

INF = float("inf")


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def loss_of(model, x, y, poison=False):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    return loss * (INF if poison else 1.0)


def run_ours(make_opt, poison, steps=14, **kw):
    model = net()
    opt = mp.LossScaleOptimizer(make_opt(model), **kw)
    scales = []
    for i, (x, y) in enumerate(batches(steps)):
        opt.scale_loss(loss_of(model, x, y, i in poison)).backward()
        opt.step()
        opt.zero_grad()
        scales.append(float(opt.loss_scale))
    return model, opt, scales


def run_gradscaler(make_opt, poison, steps=14, init_scale=2.0**15, growth_interval=2000):
    model = net()
    opt = make_opt(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    scales = []
    for i, (x, y) in enumerate(batches(steps)):
        scaler.scale(loss_of(model, x, y, i in poison)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return model, opt, scales


OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adam-foreach": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True),
    "adamw-fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_matches_gradscaler_step_for_step(name):
    poison = {1, 4, 5, 9}
    ours, ours_opt, s1 = run_ours(OPTIMIZERS[name], poison, initial_scale=2.0**15, dynamic_growth_steps=3)
    ref, ref_opt, s2 = run_gradscaler(OPTIMIZERS[name], poison, growth_interval=3)
    assert s1 == s2
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))
    assert ours_opt.num_skipped_steps == len(poison)
    step_a = [s["step"] for s in ours_opt.state.values() if "step" in s]
    step_b = [s["step"] for s in ref_opt.state.values() if "step" in s]
    assert [float(a) for a in step_a] == [float(b) for b in step_b]


@pytest.mark.parametrize("name", ["sgd", "adam-foreach"])
def test_a_train_step_under_torch_compile_matches_the_eager_one(name):
    # torch's own recipe compiles the optimizer step; dynamo took the wrapper for one of torch's
    # Optimizers and lost its bookkeeping across the step's graph break (TypeError on found_inf)
    eager_model, eager_opt, eager_scales = run_ours(OPTIMIZERS[name], poison={3}, steps=6)
    model = net()
    opt = mp.LossScaleOptimizer(OPTIMIZERS[name](model))

    @torch.compile(backend="eager")
    def train_step(x, y, poison):
        opt.scale_loss(loss_of(model, x, y, poison)).backward()
        opt.step()
        opt.zero_grad()

    scales = []
    for i, (x, y) in enumerate(batches(6)):
        train_step(x, y, i == 3)
        scales.append(float(opt.loss_scale))
    assert scales == eager_scales and opt.num_skipped_steps == eager_opt.num_skipped_steps == 1
    for a, b in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b)

    # the inner optimizer's own step compiled on its own, inside the wrapper's eager step
    model = net()
    inner = OPTIMIZERS[name](model)
    inner.step = torch.compile(inner.step, backend="eager")
    opt = mp.LossScaleOptimizer(inner)
    for i, (x, y) in enumerate(batches(6)):
        opt.scale_loss(loss_of(model, x, y, i == 3)).backward()
        opt.step()
        opt.zero_grad()
    assert opt.num_skipped_steps == 1
    for a, b in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_skipped_step_changes_nothing(name):
    model = net()
    opt = mp.LossScaleOptimizer(OPTIMIZERS[name](model))
    (x, y), (x2, y2) = batches(2)
    opt.scale_loss(loss_of(model, x, y)).backward()
    opt.step()
    opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()}
    opt.scale_loss(loss_of(model, x2, y2, poison=True)).backward()
    opt.step()
    assert opt.last_step_skipped and opt.num_skipped_steps == 1
    assert float(opt.loss_scale) == 2.0**14
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    for k, s in opt.state.items():
        assert all(torch.equal(v, state[k][n]) for n, v in s.items())
    # the next step's check reuses the device flags: the last step's answer stays until its step
    opt.zero_grad()
    opt.scale_loss(loss_of(model, x, y)).backward()
    opt.unscale_()
    assert opt.last_step_skipped
    opt.step()
    assert not opt.last_step_skipped and opt.num_skipped_steps == 1


def test_two_hundred_overflows_leave_weights_untouched_and_scale_at_floor():
    model = net()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    params = [p.detach().clone() for p in model.parameters()]
    x, y = batches(1)[0]
    for _ in range(200):
        opt.scale_loss(loss_of(model, x, y, poison=True)).backward()
        opt.step()
        opt.zero_grad()
    assert float(opt.loss_scale) == 1.0 and opt.num_skipped_steps == 200
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    opt.scale_loss(loss_of(model, x, y)).backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def train_with(ours, lr, steps, accumulate=1, clip=None):
    """Trains with our wrapper or with hand-written GradScaler; `accumulate` micro-batches per step."""
    model = net()
    inner = torch.optim.SGD(model.parameters(), lr=lr)
    opt = mp.LossScaleOptimizer(inner) if ours else inner
    scaler = None if ours else torch.amp.GradScaler("cpu", init_scale=2.0**15)
    data = batches(steps * accumulate)
    for i in range(0, len(data), accumulate):
        for x, y in data[i:i + accumulate]:
            loss = loss_of(model, x, y) / accumulate
            (opt.scale_loss(loss) if ours else scaler.scale(loss)).backward()
        if clip is not None:
            opt.unscale_() if ours else scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if ours:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return model


def same_weights(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def same_weights_as(model, values):
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), values))


def test_unscale_before_clipping_matches_gradscaler():
    assert same_weights(train_with(True, 0.5, 5, clip=0.1), train_with(False, 0.5, 5, clip=0.1))


def test_unscale_twice_is_an_error():
    model = net()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.scale_loss(loss_of(model, *batches(1)[0])).backward()
    opt.unscale_()
    with pytest.raises(RuntimeError, match="already called since the last step"):
        opt.unscale_()
    # the gradients it unscaled are cleared: the next step checks what a new backward makes (it
    # took the first unscale_'s "finite" and stepped on infinite gradients before)
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    opt.scale_loss(loss_of(model, *batches(1)[0]) * INF).backward()
    opt.step()
    assert opt.last_step_skipped and same_weights_as(model, before)


def test_gradient_accumulation_matches_gradscaler():
    assert same_weights(train_with(True, 0.1, 2, accumulate=4), train_with(False, 0.1, 2, accumulate=4))


def test_several_optimizers_share_one_scale_and_skip_together():
    model = net()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.Adam(model[2].parameters(), lr=0.1)
    opt = mp.LossScaleOptimizer([first, second])
    params = [p.detach().clone() for p in model.parameters()]
    model[2].weight.register_hook(lambda g: g * INF)  # overflow in the second optimizer's part only
    opt.scale_loss(loss_of(model, *batches(1)[0])).backward()
    opt.step()
    assert opt.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert len(opt.param_groups) == 2 and opt.inner_optimizers == [first, second]


def test_lr_scheduler_drives_the_shared_param_groups():
    model = net()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    opt = mp.LossScaleOptimizer(inner)
    assert opt.param_groups is inner.param_groups
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in batches(3):
        opt.scale_loss(loss_of(model, x, y)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert inner.param_groups[0]["lr"] == 0.125


def test_state_dict_resumes_bit_for_bit():
    poison = {2}
    full, full_opt, _ = run_ours(OPTIMIZERS["adam-foreach"], poison, steps=10, dynamic_growth_steps=2)
    model = net()
    opt = mp.LossScaleOptimizer(OPTIMIZERS["adam-foreach"](model), dynamic_growth_steps=2)
    data = batches(10)
    for i, (x, y) in enumerate(data[:5]):
        opt.scale_loss(loss_of(model, x, y, i in poison)).backward()
        opt.step()
        opt.zero_grad()
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    model2 = net(seed=5)
    model2.load_state_dict(saved_model)
    opt2 = mp.LossScaleOptimizer(OPTIMIZERS["adam-foreach"](model2), dynamic_growth_steps=2)
    opt2.load_state_dict(saved_opt)
    for x, y in data[5:]:
        opt2.scale_loss(loss_of(model2, x, y)).backward()
        opt2.step()
        opt2.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), model2.parameters()))
    assert float(opt2.loss_scale) == float(full_opt.loss_scale)
    assert opt2.num_skipped_steps == full_opt.num_skipped_steps == 1


def test_an_optimizer_state_without_its_scale_loads_and_says_the_scale_stays(caplog):
    """torch.distributed.checkpoint's get_state_dict keeps an optimizer's 'state' and
    'param_groups' only (a torch optimizer's own state_dict has no scale either): loaded into a
    scaling wrapper, the optimizer state loads and one log line says the scale stays, with the
    way to carry it; a wrapper that scales nothing has no scale to lose and says nothing."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = net()
    opt = mp.LossScaleOptimizer(OPTIMIZERS["adam-foreach"](model), initial_scale=2.0 ** 10)
    for x, y in batches(2):
        opt.scale_loss(loss_of(model, x, y)).backward()
        opt.step()
        opt.zero_grad()
    _, saved = get_state_dict(model, opt)
    assert set(saved) == {"state", "param_groups"}
    model2 = net(seed=5)
    opt2 = mp.LossScaleOptimizer(OPTIMIZERS["adam-foreach"](model2), initial_scale=2.0 ** 7)
    with caplog.at_level("WARNING", logger="mixedpolicy"):
        set_state_dict(model2, opt2, model_state_dict=model.state_dict(), optim_state_dict=saved)
    said = [r.getMessage() for r in caplog.records if "holds no loss scale" in r.getMessage()]
    assert len(said) == 1 and "the scale stays at 128.0" in said[0] and "opt.scaler_state_dict()" in said[0], said
    assert float(opt2.loss_scale) == 128.0
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    caplog.clear()
    passing = mp.LossScaleOptimizer(OPTIMIZERS["adam-foreach"](net()), policy="mixed_bfloat16")
    with caplog.at_level("WARNING", logger="mixedpolicy"):
        passing.load_state_dict(opt.inner_optimizer.state_dict())
    assert not [r for r in caplog.records if "loss scale" in r.getMessage()]


def test_scale_state_moves_to_and_from_gradscaler():
    model = net()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_growth_steps=7)
    opt.scale_loss(loss_of(model, *batches(1)[0], poison=True)).backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(opt.scaler_state_dict())
    assert scaler.get_scale() == 2.0**14 and scaler.get_growth_interval() == 7
    assert scaler.state_dict() == opt.scaler_state_dict()
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=5)
    opt.load_scaler_state_dict(scaler2.state_dict())
    assert float(opt.loss_scale) == 1024.0 and opt.scaler_state_dict()["growth_interval"] == 5
    with pytest.raises(ValueError, match="without \\['_growth_tracker'\\]"):
        opt.load_scaler_state_dict({"scale": 2.0})
    assert float(opt.loss_scale) == 1024.0


def test_a_cuda_gradscaler_made_on_cpu_is_refused_and_nothing_is_loaded():
    # torch.amp.GradScaler("cuda") without CUDA only warns, disables itself and saves {};
    # on a machine with CUDA it works, so a scaler disabled outright stands in for it.
    if torch.cuda.is_available():
        disabled = torch.amp.GradScaler("cpu", enabled=False)
    else:
        with pytest.warns(UserWarning, match="CUDA is not available"):
            disabled = torch.amp.GradScaler("cuda")
    assert disabled.state_dict() == {}
    model = net()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    opt.scale_loss(loss_of(model, *batches(1)[0])).backward()
    opt.step()
    saved = opt.state_dict()
    with pytest.raises(ValueError, match="empty scaler state dict.*GradScaler\\('cuda'\\).*without CUDA"):
        opt.load_scaler_state_dict(disabled.state_dict())
    fresh = mp.LossScaleOptimizer(torch.optim.SGD(net().parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match="empty scaler state dict"):
        fresh.load_state_dict(dict(saved, loss_scale=disabled.state_dict()))
    assert fresh.state_dict()["state"] == {}, "the inner state was loaded before the refusal"
    with pytest.raises(TypeError, match="scaler state of type float"):
        opt.load_scaler_state_dict(1024.0)
    for bad in ({}, {"loss_scale": saved["loss_scale"]}, {"state": {}}):  # not an optimizer's state
        with pytest.raises(ValueError, match=r"optimizer state without \[.*param_groups.*nothing was loaded"):
            fresh.load_state_dict(bad)
    assert float(fresh.loss_scale) == 2.0**15 and fresh.state_dict()["state"] == {}  # untouched


def test_a_capturable_optimizer_on_cpu_parameters_is_refused_up_front():
    model = net()
    with pytest.raises(ValueError, match=r"Adam\(capturable=True\).*on cpu.*CUDA-graph.*capturable=False"):
        mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), capturable=True))
    # The default, and fused kernels (which torch runs on CPU too), are accepted.
    mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), fused=True))


def test_half_master_weights_are_an_error():
    model = net().half()
    with pytest.raises(ValueError, match="float16 master weights.*float32"):
        mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_an_eps_that_is_zero_in_float16_over_float16_weights_is_warned_of_where_it_would_make_nan():
    import warnings

    def wrapped(make, dtype):
        weights = torch.nn.Parameter(torch.ones(4, dtype=dtype))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt = mp.LossScaleOptimizer(make([weights]), loss_scale=mp.NoLossScale())
        return weights, opt, [w for w in seen if "eps=" in str(w.message)]

    weights, opt, seen = wrapped(lambda p: torch.optim.Adam(p, lr=1e-3), torch.float16)
    assert len(seen) == 1 and "eps=1e-08, which is 0 in float16" in str(seen[0].message)
    assert seen[0].filename == __file__  # where the user made the wrapper
    # what it warns of: a gradient of 0 (or a small one) gives a NaN (inf) update, and so does Adam alone
    weights.grad = torch.tensor([0.0, 1e-5, 1e-3, 1.0], dtype=torch.float16)
    opt.step()
    assert not torch.isfinite(weights[:3]).any() and torch.isfinite(weights[3:]).all()
    for make, dtype in [(lambda p: torch.optim.Adam(p, lr=1e-3, eps=1e-4), torch.float16),
                        (lambda p: torch.optim.Adam(p, lr=1e-3), torch.bfloat16),
                        (lambda p: torch.optim.Adam(p, lr=1e-3), torch.float32),
                        (lambda p: torch.optim.SGD(p, lr=1e-3), torch.float16)]:
        weights, opt, seen = wrapped(make, dtype)
        assert not seen, (dtype, seen)
    # a group added later is looked at as the constructor's are (with the optimizer's default eps)
    _, opt, _ = wrapped(lambda p: torch.optim.Adam(p, lr=1e-3), torch.float32)
    with pytest.warns(UserWarning, match="eps=1e-08, which is 0 in float16"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, dtype=torch.float16))]})
    weights = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    weights.grad = torch.tensor([0.0, 1e-5, 1e-3, 1.0], dtype=torch.float16)
    opt = mp.LossScaleOptimizer(torch.optim.Adam([weights], lr=1e-3, eps=1e-4), loss_scale=mp.NoLossScale())
    opt.step()
    assert torch.isfinite(weights).all()


def test_step_takes_a_closure_and_calls_it_once_as_torch_optimizers_do():
    data = batches(3)

    def train(with_closure):
        model = net()
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        calls, losses = [0], []
        for step, (x, y) in enumerate(data):
            def closure(x=x, y=y, step=step):
                calls[0] += 1
                opt.zero_grad()
                loss = loss_of(model, x, y, poison=step == 1)
                opt.scale_loss(loss).backward()
                return loss
            if with_closure:
                losses.append(opt.step(closure))
            else:
                losses.append(closure())
                assert opt.step() is None
        return model, opt, losses, calls[0]

    ours, opt, losses, calls = train(True)
    plain, plain_opt, plain_losses, _ = train(False)
    assert calls == 3 and opt.num_skipped_steps == 1 == plain_opt.num_skipped_steps
    assert [float(a) for a in losses] == [float(b) for b in plain_losses]
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), plain.parameters()))


def test_lbfgs_is_refused_under_scaling_and_passed_its_closure_otherwise():
    model = net()
    with pytest.raises(TypeError, match="LBFGS under dynamic.*re-evaluates"):  # at construction
        mp.LossScaleOptimizer(torch.optim.LBFGS(model.parameters()))
    x, y = batches(1)[0]

    def run(poison, **kw):
        model = net()
        opt = mp.LossScaleOptimizer(torch.optim.LBFGS(model.parameters(), max_iter=3), policy="float32", **kw)

        def closure():
            opt.zero_grad()
            loss = loss_of(model, x, y, poison)
            opt.scale_loss(loss).backward()
            return loss
        before = [p.detach().clone() for p in model.parameters()]
        loss = opt.step(closure)
        return model, opt, before, loss

    model, opt, before, loss = run(poison=False)
    assert torch.isfinite(loss) and not opt.last_step_skipped
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    model, opt, before, _ = run(poison=True)  # checked at the first evaluation: nothing moved
    assert opt.last_step_skipped and opt.num_skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    model, opt, before, _ = run(poison=True, skip_nonfinite=False)  # exactly LBFGS's own step
    assert opt.num_skipped_steps == 0


def test_a_step_whose_loss_was_not_scaled_is_refused_under_scaling():
    model = net()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()  # forgot opt.scale_loss: the update would be 32768x too small
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="no loss was scaled.*scale_loss\\(loss\\).backward"):
        opt.step()
    with pytest.raises(RuntimeError, match="no loss was scaled"):
        opt.unscale_()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    opt.zero_grad()
    opt.scale_loss(loss_of(model, x, y)).backward()  # accumulating several scaled losses is fine
    opt.scale_loss(loss_of(model, x, y)).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="no loss was scaled.*a second step on gradients a step already took"):
        opt.step()  # the same gradients again (GradScaler: "step() has already been called since the last update()")
    loss_of(model, x, y).backward()  # the flag is per step
    with pytest.raises(RuntimeError, match="no loss was scaled"):
        opt.step()
    # a GradScaler stepping the wrapper: both scale; the refusal says so, not "loss.backward()"
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_of(model, x, y)).backward()
    with pytest.raises(RuntimeError, match=r"called by a torch.amp.GradScaler .* both scale the loss.*inner_optimizer"):
        scaler.step(opt)
    opt.zero_grad()  # the fix it names: the GradScaler with the plain optimizer
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_of(model, x, y)).backward()
    scaler.step(opt.inner_optimizer)
    scaler.update()


def test_isinstance_and_type():
    opt = mp.LossScaleOptimizer(torch.optim.SGD(net().parameters(), lr=0.1))
    assert isinstance(opt, mp.LossScaleOptimizer) and isinstance(opt, torch.optim.Optimizer)
    assert not isinstance(torch.optim.SGD(net().parameters(), lr=0.1), mp.LossScaleOptimizer)


def test_loading_a_gradscaler_dict_keeps_the_skip_count():
    model = net()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.scale_loss(loss_of(model, *batches(1)[0], poison=True)).backward()
    opt.step()
    opt.load_scaler_state_dict(torch.amp.GradScaler("cpu").state_dict())
    assert opt.num_skipped_steps == 1 and float(opt.loss_scale) == 2.0**16


@contextlib.contextmanager
def host_reads():
    """Records every tensor-to-Python read (the host syncs a CUDA step would make)."""
    calls, saved = [], {}
    for name in ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "numpy"):
        saved[name] = original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)
    try:
        yield calls
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


@pytest.mark.parametrize("name, ours", [("sgd", ["item"]), ("adamw-fused", [])])
def test_a_step_reads_the_device_once_as_gradscaler_does_and_never_when_fused(name, ours):
    x, y = batches(1)[0]
    model, scaled_model = net(), net()
    opt = mp.LossScaleOptimizer(OPTIMIZERS[name](model))
    native, scaler = OPTIMIZERS[name](scaled_model), torch.amp.GradScaler("cpu")
    for poison in (False, True, False):  # an applied, a skipped and an applied step
        opt.scale_loss(loss_of(model, x, y, poison)).backward()
        with host_reads() as reads:
            opt.step()
        opt.zero_grad()
        scaler.scale(loss_of(scaled_model, x, y, poison)).backward()
        with host_reads() as native_reads:
            scaler.step(native)
            scaler.update()
        native.zero_grad()
        assert reads == native_reads == ours


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "float32"])
@pytest.mark.parametrize("make", [lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, **kw),
                                  lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, **kw)], ids=["sgd", "adamw"])
def test_where_a_host_read_stalls_the_device_an_unchosen_implementation_takes_the_fused_kernel(
        policy, make, monkeypatch):
    """On a GPU a non-fused optimizer's skip reads the found-inf flag on the host (13% of an eager
    GPT-2 step on an H100); torch's fused kernel skips on the device. Run here on the CPU as if
    the read stalled it: the optimizer takes the fused kernel and trains as one made fused."""
    from mixedpolicy.backends.torch import checks

    def train(fused, costly):
        monkeypatch.setattr(checks, "_SYNC_COSTLY", costly)
        torch.manual_seed(0)
        model = mp.apply_policy(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
                                policy)
        inner = make(model.parameters(), **({"fused": True} if fused else {}))
        opt = mp.LossScaleOptimizer(inner, policy=policy)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        for i in range(4):
            loss = model(x).float().pow(2).mean()
            opt.scale_loss(loss * float("inf") if i == 2 else loss).backward()
            opt.step()
            opt.zero_grad()
        return inner, opt.num_skipped_steps, [p.detach().clone() for p in model.parameters()]

    taken, skipped, weights = train(False, {"cpu"})
    assert taken.param_groups[0]["fused"] is True and taken._step_supports_amp_scaling
    made, made_skipped, made_weights = train(True, {"cpu"})
    assert skipped == made_skipped == 1
    for a, b in zip(weights, made_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    kept, _, _ = train(False, set())  # on the CPU as it is: the read costs nothing, nothing changes
    assert kept.param_groups[0]["fused"] is None and not getattr(kept, "_step_supports_amp_scaling", False)


def test_an_implementation_the_user_chose_is_kept(monkeypatch):
    from mixedpolicy.backends.torch import checks

    monkeypatch.setattr(checks, "_SYNC_COSTLY", {"cpu"})
    for kw in ({"foreach": True}, {"foreach": False}, {"fused": False}):
        model = torch.nn.Linear(4, 2)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **kw)
        opt = mp.LossScaleOptimizer(inner, policy="mixed_bfloat16")
        opt.scale_loss(model(torch.ones(3, 4)).sum()).backward()
        opt.step()
        assert inner.param_groups[0]["fused"] in (None, False) and inner.param_groups[0]["foreach"] == kw.get("foreach")


class _Bag(torch.nn.Module):
    """A sparse embedding bag (its gradient is a sparse tensor) and a dense head: one device and
    one dtype, the partition the step checks in the fewest Python operations."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 8, sparse=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_sparse_gradients_beside_dense_ones_are_unscaled_and_checked_as_grad_scaler_does(policy):
    """torch's AMP kernel refuses a sparse gradient at dispatch: the step's path for one device
    and one dtype hands such a step to the general one, which unscales the sparse values. The
    same weights as autocast + GradScaler step for step, the overflow skipped by both."""
    ids = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(1))
    half = policy == "mixed_float16"
    model = mp.apply_policy(_Bag(), policy)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), policy=policy)
    ref = _Bag()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15, enabled=half)
    for step in range(4):
        poison = float("inf") if step == 1 else 1.0
        opt.scale_loss(model(ids).float().pow(2).mean() * poison).backward()
        opt.step()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=half):
            out = ref(ids)
        scaler.scale(out.float().pow(2).mean() * poison).backward()
        if half:
            scaler.step(ref_opt)
            scaler.update()
        elif step != 1:  # (float32 has no GradScaler: the bare optimizer leaves the inf step out)
            ref_opt.step()
        ref_opt.zero_grad()
        assert opt.last_step_skipped == (step == 1)
    assert opt.num_skipped_steps == 1 and (not half or float(opt.loss_scale) == scaler.get_scale())
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_complex_parameter_steps_as_the_bare_optimizer_and_its_inf_is_skipped(policy):
    """torch's AMP kernel refuses complex gradients (GradScaler fails on them): the step checks
    and unscales them through their float view, and the core's all_finite reads them too."""
    def make():
        return [torch.nn.Parameter(torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64)),
                torch.nn.Parameter(torch.ones(2))]

    params, ref = make(), make()
    opt = mp.LossScaleOptimizer(torch.optim.Adam(params, lr=0.1), policy=policy)
    ref_opt = torch.optim.Adam(ref, lr=0.1)
    for poison in (1.0, float("inf"), 1.0):
        opt.scale_loss((params[0] * poison).abs().pow(2).sum() + params[1].pow(2).sum()).backward()
        assert not mp.all_finite([p.grad for p in params]) if poison != 1.0 else mp.all_finite(
            [p.grad for p in params])
        opt.step()
        opt.zero_grad()
        assert opt.last_step_skipped == (poison != 1.0)
        if poison == 1.0:
            (ref[0].abs().pow(2).sum() + ref[1].pow(2).sum()).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b)


def test_a_flag_another_device_left_set_is_zeroed_before_that_device_is_checked_again():
    """A step reads as 0 only the flags its check set: a device whose flag an earlier skip left
    at 1 (another optimizer's parameters, stepped by `acting_on`) is zeroed before it is read
    again, so its next finite step is not skipped."""
    from mixedpolicy.backends.torch.found_inf import FoundInf

    checks, other = FoundInf(), torch.device("cpu", 1)  # (a second device's key, as on two GPUs)
    checks.flags[other] = torch.ones(())
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    found = checks.check([{"params": [p]}], True, None, torch.ones(()), "step()")
    assert found.item() == 0
    checks.read_as_zero()
    assert other not in checks.clean and torch.device("cpu") in checks.clean


def _gradscaler_loop(model, opt, scaler, poison, steps=14):
    """A loop written for torch.amp.GradScaler, as its docs write it; `scaler` is a GradScaler
    or the LossScaleOptimizer itself, standing in for one."""
    scales = []
    for i, (x, y) in enumerate(batches(steps)):
        if i == 6:
            scaler.set_growth_interval(2)  # settings changed mid-run, through GradScaler's setters
            scaler.set_growth_factor(4.0)
            scaler.set_backoff_factor(0.25)
        scaler.scale(loss_of(model, x, y, i in poison)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def test_a_loop_written_for_grad_scaler_runs_as_written_with_the_wrapper_in_its_place():
    """scale, unscale_(opt), step(opt), update and the setters answer as GradScaler's: the same
    scales, skips and weights, with the settings changed mid-run (scale was missing, and the
    set_growth_interval / set_growth_factor / set_backoff_factor setters)."""
    poison = {1, 8}
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    theirs = _gradscaler_loop(ref, ref_opt, torch.amp.GradScaler("cpu", init_scale=2.0**15, growth_interval=3), poison)
    ours = net()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), initial_scale=2.0**15,
                                dynamic_growth_steps=3, max_scale=2.0**40)  # (GradScaler has no ceiling)
    assert _gradscaler_loop(ours, opt, opt, poison) == theirs and opt.num_skipped_steps == len(poison)
    assert same_weights(ours, ref)
    assert (opt.get_growth_interval(), opt.get_growth_factor(), opt.get_backoff_factor()) == (2, 4.0, 0.25)
    with pytest.raises(ValueError, match="growth_factor"):
        opt.set_growth_factor(0.5)  # checked as the constructor checks it
    with pytest.raises(ValueError, match=r"In set_growth_factor\(array\(\[1., 1.\]\)\): Received growth_factor"):
        opt.set_growth_factor(np.ones(2))  # (an array's truth value was asked for)
    with pytest.raises(ValueError, match=r"In set_growth_interval\(2.5\): .*whole number"):
        opt.set_growth_interval(2.5)
    assert (opt.get_growth_interval(), opt.get_growth_factor()) == (2, 4.0)  # nothing changed
    static = mp.LossScaleOptimizer(torch.optim.SGD(net().parameters(), lr=0.1), loss_scale=mp.StaticLossScale(8.0))
    with pytest.raises(ValueError, match="static scale"):
        static.set_growth_interval(5)
    passing = mp.LossScaleOptimizer(torch.optim.SGD(net().parameters(), lr=0.1), policy="bfloat16")
    passing.set_growth_factor(3.0)  # nothing scales: a no-op, as on a disabled GradScaler
    assert not passing.is_enabled()


def test_a_grad_scaler_checkpoint_resumes_with_the_wrapper_in_the_scalers_place(caplog):
    """A GradScaler loop's checkpoint ({"optimizer": opt.state_dict(), "scaler":
    scaler.state_dict()}) loads as that loop loads it, `scaler.load_state_dict(...)`, into the
    wrapper standing in for the scaler: the scale and its growth counter come back (logged),
    the optimizer state is left to the optimizer's own load, and training goes on as
    GradScaler's would."""
    poison = {1, 8}
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15, growth_interval=3)
    _gradscaler_loop(ref, ref_opt, scaler, poison, steps=4)
    ckpt = copy.deepcopy({"model": ref.state_dict(), "optimizer": ref_opt.state_dict(),
                          "scaler": scaler.state_dict()})  # as torch.save would keep it
    theirs = _gradscaler_loop(ref, ref_opt, scaler, {2}, steps=6)

    ours = net(seed=3)
    ours.load_state_dict(ckpt["model"])
    inner = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    opt = mp.LossScaleOptimizer(inner, policy="mixed_float16")
    inner.load_state_dict(ckpt["optimizer"])
    with caplog.at_level("INFO", logger="mixedpolicy"):
        opt.load_state_dict(ckpt["scaler"])
    assert "GradScaler state (scale 16384.0)" in caplog.text
    assert opt.get_growth_interval() == 3
    assert _gradscaler_loop(ours, opt, opt, {2}, steps=6) == theirs and same_weights(ours, ref)
    with pytest.raises(ValueError, match="an empty dict is what a disabled GradScaler saves"):
        opt.load_state_dict(torch.amp.GradScaler("cpu", enabled=False).state_dict())


def _two_models_loop(scaler, models, optimizers, skip_iter=3, steps=8):
    """GradScaler's documented loop over two models and two optimizers fed by two losses: one
    optimizer unscaled on its own, each stepped by name, one update an iteration; at `skip_iter`
    the second model's gradient is made infinite (torch's own test of it does the same)."""
    scales = []
    for i, (x, y) in enumerate(batches(steps)):
        out0, out1 = models[0](x), models[1](x)
        loss0 = torch.nn.functional.cross_entropy(out0 + out1, y)
        loss1 = torch.nn.functional.cross_entropy(out0 - out1, y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        if i == skip_iter:
            models[1][2].weight.grad.fill_(INF)
        scaler.unscale_(optimizers[0])
        torch.nn.utils.clip_grad_norm_(models[0].parameters(), 1.0)
        scaler.step(optimizers[0])
        scaler.step(optimizers[1])
        scaler.update()
        for opt in optimizers:
            opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def test_several_optimizers_stepped_by_name_skip_alone_and_move_the_scale_once_as_grad_scaler():
    """With the wrapper of both in the scaler's place, GradScaler's multi-optimizer loop runs as
    written: the optimizer whose gradients overflowed skips, the other steps, and update() backs
    the scale off once (it was refused: a wrapper of several took only step() of all)."""
    make = lambda ms: [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in ms]  # noqa: E731
    ref = [net(0), net(1)]
    ref_opts = make(ref)
    theirs = _two_models_loop(torch.amp.GradScaler("cpu", init_scale=2.0**15, growth_interval=2), ref, ref_opts)
    ours = [net(0), net(1)]
    opts = make(ours)
    wrapper = mp.LossScaleOptimizer(opts, initial_scale=2.0**15, dynamic_growth_steps=2)
    assert _two_models_loop(wrapper, ours, opts) == theirs
    assert all(same_weights(a, b) for a, b in zip(ours, ref))
    assert wrapper.num_skipped_steps == 1 and not wrapper.last_step_skipped
    # refused as GradScaler refuses them: a second unscale_ or step of one optimizer before update()
    x, y = batches(1)[0]
    wrapper.scale(torch.nn.functional.cross_entropy(ours[0](x) + ours[1](x), y)).backward()
    wrapper.unscale_(opts[0])
    with pytest.raises(RuntimeError, match="already called for this optimizer since the last update"):
        wrapper.unscale_(opts[0])
    wrapper.step(opts[0])
    with pytest.raises(RuntimeError, match="already called for this optimizer since the last update"):
        wrapper.step(opts[0])
    wrapper.step(opts[1])
    wrapper.update()
    with pytest.raises(ValueError, match="an optimizer that this LossScaleOptimizer over .* does not wrap"):
        wrapper.step(torch.optim.SGD(net().parameters(), lr=0.1))  # an optimizer it does not hold



def test_a_check_only_steps_short_path_sees_every_change_the_full_one_would():
    """A wrapper that only checks (no scale, one optimizer) takes a short path from its second
    step on; a step after the groups changed, a gradient made infinite, a hook or a sparse
    gradient behaves as on the first step."""
    model, extra = net(), torch.nn.Parameter(torch.zeros(2))
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=mp.NoLossScale())
    x, y = batches(1)[0]
    params = list(model.parameters()) + [extra]

    def step(poison=None):
        """One step; whether every parameter was left as it was."""
        opt.zero_grad()
        (loss_of(model, x, y) + extra.sum()).backward()
        if poison is not None:
            poison.grad.view(-1)[0] = INF
        before = [p.detach().clone() for p in params]
        opt.step()
        return all(torch.equal(a, b) for a, b in zip(before, params))

    for _ in range(3):
        assert not step()
    assert step(poison=model[2].weight) and opt.last_step_skipped and opt.num_skipped_steps == 1
    assert not step() and not opt.last_step_skipped
    # a group added, then a group's list grown in place: their gradients are checked too
    opt.add_param_group({"params": [extra]})
    assert not step() and extra.detach().abs().sum() > 0
    assert step(poison=extra) and opt.num_skipped_steps == 2
    grown = torch.nn.Parameter(torch.zeros(1))
    opt.param_groups[1]["params"].append(grown)
    params.append(grown)
    grown.grad = torch.full((1,), float("nan"))
    before = [p.detach().clone() for p in params]
    opt.step()  # (no backward since: the gradients as they are, one NaN among them)
    assert opt.num_skipped_steps == 3 and all(torch.equal(a, b) for a, b in zip(before, params))
    # a step hook registered on the wrapper now runs
    calls = []
    opt.register_step_post_hook(lambda *args: calls.append(1))
    assert not step() and calls == [1]
    # a sparse gradient: the general path, which checks it
    emb = torch.nn.Embedding(5, 2, sparse=True)
    sparse = mp.LossScaleOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), loss_scale=mp.NoLossScale())
    for poison in (False, False, True):
        sparse.zero_grad()
        (emb(torch.tensor([1, 2])).sum() * (INF if poison else 1.0)).backward()
        sparse.step()
    assert sparse.num_skipped_steps == 1
