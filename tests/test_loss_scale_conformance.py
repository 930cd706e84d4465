"""Regressions from the conformance review: loss scales never silently wrong, bad input refused."""

import pickle
import copy

import numpy as np
import pytest

from conftest import require_module

import mixedpolicy as mp
from mixedpolicy.loss_scale import all_finite


@pytest.fixture(autouse=True)
def _where_loss_scaling_is_on():
    """These tests are about scaling: they run under a float16 global policy, where
    LossScaleOptimizer(opt) scales (tests/test_loss_scale_follows_policy.py: the rest)."""
    mp.set_global_policy("mixed_float16")  # the root conftest restores it


# -- the core, on numpy and Python numbers ---------------------------------------------
def test_python_float_gradients_are_unscaled_and_checked():
    s = mp.DynamicLossScale(4.0)
    assert s.unscale({"g": 32768.0}) == {"g": 8192.0}
    assert not bool(all_finite({"g": float("inf")}))
    assert bool(all_finite({"g": 1.0, "h": np.ones(2, np.float32)}))


def test_all_finite_checks_python_floats_and_numpy_leaves_beside_a_frameworks_tensors(backend):
    """As jmp's all_finite: every floating leaf counts, whichever framework holds it, each in its
    own dtype (a float64 1e300 is finite; it was cast to float32 and read as inf)."""
    ones = backend.asarray(np.ones(3), "float32")
    assert bool(all_finite({"t": ones, "g": 1.0, "h": np.float64(1e300), "n": np.array([1e300])}))
    assert not bool(all_finite({"t": ones, "g": float("inf")}))
    assert not bool(all_finite({"t": ones, "h": np.array([0.0, np.nan], np.float32)}))
    assert not bool(all_finite([ones, np.float16(np.inf)]))
    assert bool(all_finite({"t": ones, "step": 3, "flag": True}))  # integers are not looked at

    class Held:  # an array-like no framework here reads (as a Keras variable holds its backend's array)
        def __init__(self, value):
            self.value, self.dtype, self.shape = np.asarray(value, np.float32), np.dtype("float32"), (1,)

        def __array__(self, dtype=None, copy=None):
            return self.value

    assert not bool(all_finite({"t": ones, "v": Held([np.inf])})) and bool(all_finite([ones, Held([2.0])]))
    for text in ("grads", b"grads"):  # a name is not a tree of arrays (jmp's fails on it too)
        with pytest.raises(TypeError, match=r"Received the (str|bytes) b?'grads' among the leaves; expected arrays"):
            all_finite({"t": ones, "name": text})


def test_scale_takes_a_tree_on_every_loss_scale():
    tree = {"a": np.ones(2, np.float16), "n": np.arange(2)}
    for s in (mp.StaticLossScale(8.0), mp.DynamicLossScale(8.0)):
        out = s.scale(tree)
        assert out["a"].dtype == np.float32 and float(out["a"][0]) == 8.0
        assert out["n"] is tree["n"]
    assert mp.NoLossScale().scale(tree) is tree


@pytest.mark.parametrize("bad", [1e-50, float("nan"), float("inf"), 0.0, -1.0])
def test_a_floor_or_scale_that_is_not_a_positive_float32_is_refused(bad):
    with pytest.raises(ValueError, match="Received min_scale"):
        mp.DynamicLossScale(min_scale=bad)
    with pytest.raises(ValueError, match="Received loss_scale"):
        mp.StaticLossScale(bad)


def test_boolean_and_non_scalar_scale_arrays_are_refused():
    with pytest.raises(TypeError, match="dtype bool"):
        mp.StaticLossScale(np.asarray(True))
    with pytest.warns(UserWarning, match="Expected floating type"):  # jmp warns; taken as float32
        assert mp.StaticLossScale(np.asarray(8, np.int32)).loss_scale.dtype == np.float32
    with pytest.raises(ValueError, match="NaN"):
        mp.DynamicLossScale(np.asarray(np.nan, np.float32))
    with pytest.raises(ValueError, match="shape"):
        mp.StaticLossScale(np.ones(3, np.float32))


@pytest.mark.parametrize("bad", ["x", 1.5, True, None, -3])
def test_a_bad_counter_is_refused(bad):
    with pytest.raises((TypeError, ValueError), match="counter"):
        mp.DynamicLossScale(counter=bad)


@pytest.mark.parametrize("bad", [None, float("nan"), [True, False], 1, np.ones(2, bool), "yes"])
@pytest.mark.parametrize("cls", [mp.DynamicLossScale, mp.StaticLossScale, mp.NoLossScale])
def test_adjust_refuses_what_is_not_a_boolean_flag(cls, bad):
    with pytest.raises(TypeError, match="grads_finite"):
        cls().adjust(bad)


# -- JAX: the scale follows the gradients, travels through jit -----------------------
def test_jax_gradients_and_scales_mix_with_numpy_either_way():
    jax = require_module("jax")
    jnp = jax.numpy
    assert float(mp.DynamicLossScale(4.0).unscale({"g": jnp.float32(8.0)})["g"]) == 2.0
    assert float(mp.DynamicLossScale(jnp.float32(4.0)).unscale({"g": np.float32(8.0)})["g"]) == 2.0
    g = mp.StaticLossScale(4.0).unscale({"g": jnp.ones(2, jnp.bfloat16) * 8})["g"]
    assert g.dtype == jnp.bfloat16 and float(g[0]) == 2.0


def test_loss_scales_are_pytrees_and_adjust_under_jit():
    jax = require_module("jax")
    jnp = jax.numpy
    s = jax.jit(lambda s: s.adjust(jnp.bool_(False)))(mp.DynamicLossScale(jnp.float32(8.0)))
    assert isinstance(s, mp.DynamicLossScale) and float(s.loss_scale) == 4.0
    grown = jax.jit(lambda f: mp.DynamicLossScale(8.0, dynamic_growth_steps=1).adjust(f))(jnp.bool_(True))
    assert float(grown.loss_scale) == 16.0 and grown.dynamic_growth_steps == 1
    assert len(jax.tree_util.tree_leaves(mp.StaticLossScale(2.0))) == 1
    assert jax.tree_util.tree_leaves(mp.NoLossScale()) == []


def test_jmp_policy_conversion_prints():
    require_module("jax")
    require_module("jmp", "jax")
    jmp = require_module("jmp", "jax")
    text = str(mp.Policy("mixed_bfloat16").to_jmp())
    assert text == "p=full,c=bf16,o=bf16" and mp.Policy(text) == mp.Policy("mixed_bfloat16")
    assert jmp.get_policy(text) == mp.Policy("mixed_bfloat16").to_jmp()


def test_jmps_spelling_of_a_dynamic_scale_steps_as_jmps_own():
    """jmp's period, factor and min_loss_scale: jmp code moves over by its import, and the scale
    goes as jmp's does (no ceiling but float32's), step for step under jit."""
    jax = require_module("jax")
    jmp = require_module("jmp", "jax")
    jnp = jax.numpy
    # (jmp's pytree drops min_loss_scale, so under jit its floor is always 1: checked eagerly below)
    settings = dict(period=3, factor=4)
    theirs = jmp.DynamicLossScale(jnp.float32(2.0**120), **settings)
    ours = mp.DynamicLossScale(jnp.float32(2.0**120), **settings)
    flags = [True] * 14 + [False] * 70 + [True, True, True, False]
    for finite in flags:
        with jax.numpy_dtype_promotion("standard"):  # jmp multiplies its int32 counter by the flag
            theirs = jax.jit(type(theirs).adjust)(theirs, jnp.bool_(finite))
        ours = jax.jit(type(ours).adjust)(ours, jnp.bool_(finite))
        assert float(ours.loss_scale) == float(theirs.loss_scale) and int(ours.counter) == int(theirs.counter)
    assert float(ours.max_scale) == float(np.finfo(np.float32).max)
    theirs = jmp.DynamicLossScale(jnp.float32(8.0), min_loss_scale=jnp.float32(2.0))
    ours = mp.DynamicLossScale(jnp.float32(8.0), min_loss_scale=jnp.float32(2.0))
    for _ in range(3):
        with jax.numpy_dtype_promotion("standard"):
            theirs = theirs.adjust(jnp.bool_(False))
        ours = ours.adjust(jnp.bool_(False))
        assert float(ours.loss_scale) == float(theirs.loss_scale)
    assert float(ours.loss_scale) == 2.0
    with pytest.raises(TypeError, match=r"period=3 \(jmp's spelling\) and dynamic_growth_steps=2; give it once"):
        mp.DynamicLossScale(period=3, dynamic_growth_steps=2)


def test_jmps_positional_order_and_attribute_names():
    """jmp's DynamicLossScale(loss_scale, counter, period, factor, min_loss_scale), positionally,
    with its attributes: a loss scale divided by `factor` on overflow, a floor of 0 that is jmp's
    "no floor" (the scale still never reaches 0)."""
    s = mp.DynamicLossScale(np.float32(10), 0, 30, 3)
    assert (s.period, s.factor, s.min_loss_scale) == (30, 3.0, 1.0)
    np.testing.assert_allclose(float(s.adjust(False).loss_scale), 10 / 3, rtol=1e-6)
    for _ in range(29):
        s = s.adjust(True)
    assert (float(s.loss_scale), int(s.counter)) == (10.0, 29)
    assert (float(s.adjust(True).loss_scale), int(s.adjust(True).counter)) == (30.0, 0)
    s = mp.DynamicLossScale(np.float32(10), 0, 5, 2, 0.3125)
    for i in range(8):
        s = s.adjust(False)
    assert float(s.loss_scale) == 0.3125
    s = mp.DynamicLossScale(np.float32(10), 0, 5, 2, 0)
    for i in range(300):
        s = s.adjust(False)
        if i == 99:
            np.testing.assert_allclose(float(s.loss_scale), 10 / 2.0**100, rtol=1e-5)
    assert float(s.loss_scale) == float(np.finfo(np.float32).tiny) > 0
    with pytest.raises(TypeError, match=r"min_loss_scale=2.0 \(jmp's spelling\) and min_scale=1.0"):
        mp.DynamicLossScale(8.0, 0, 10, 2, 2.0, min_scale=1.0)


def test_jmps_loose_inputs_a_float_period_integer_scales_and_its_assertion():
    """jmp's tests: period=5. is a period of 5; an int32 scale or floor is taken as float32 with
    jmp's warning ("Expected floating type for ..."); select_tree's refusal of a non-scalar flag is
    also the AssertionError jmp raises ("expected boolean scalar")."""
    s = mp.DynamicLossScale(np.float32(10), np.int32(0), 5.0, 2.0, np.float32(0.0))
    assert s.period == 5 and isinstance(s.period, int)
    for _ in range(5):
        s = s.adjust(np.bool_(True))
    assert float(s.loss_scale) == 20.0
    with pytest.warns(UserWarning, match="Expected floating type for loss_scale, got int32"):
        s = mp.DynamicLossScale(np.asarray(1, np.int32))
    assert float(s.loss_scale) == 1.0 and s.loss_scale.dtype == np.float32
    with pytest.warns(UserWarning, match="Expected floating type for min_loss_scale"):
        mp.DynamicLossScale(np.asarray(1, np.float32), min_loss_scale=np.asarray(1, np.int32))
    with pytest.raises(AssertionError, match="expected boolean scalar"):
        mp.select_tree(np.ones([1]), None, None)
    with pytest.raises(ValueError, match="period|dynamic_growth_steps=2.5"):
        mp.DynamicLossScale(8.0, 0, 2.5)


# -- optax -------------------------------------------------------------------------
def _optax_step(opt, w, grads=None):
    jax = require_module("jax")
    optax = require_module("optax", "jax")
    state = opt.init(w)
    if grads is None:
        grads = jax.grad(lambda w: opt.scale_loss(w.sum(), state))(w)
    updates, state = opt.update(grads, state, w)
    return optax.apply_updates(w, updates), state


def test_optax_static_scale_unscales():
    jnp = require_module("jax").numpy
    optax = require_module("optax", "jax")
    w, _ = _optax_step(mp.LossScaleOptimizer(optax.sgd(1.0), loss_scale=mp.StaticLossScale(64.0)),
                       jnp.ones(3, jnp.float32))
    np.testing.assert_array_equal(np.asarray(w), np.zeros(3, np.float32))


def test_optax_no_loss_scale_still_skips_a_non_finite_step():
    jnp = require_module("jax").numpy
    optax = require_module("optax", "jax")
    opt = mp.LossScaleOptimizer(optax.sgd(1.0), loss_scale=mp.NoLossScale())
    w, state = _optax_step(opt, jnp.ones(3, jnp.float32), jnp.asarray([1.0, jnp.nan, 1.0]))
    np.testing.assert_array_equal(np.asarray(w), np.ones(3, np.float32))
    assert bool(state.last_step_skipped) and int(state.num_skipped_steps) == 1


def test_optax_double_wrapping_is_refused_and_multisteps_accepted():
    jnp = require_module("jax").numpy
    optax = require_module("optax", "jax")
    with pytest.raises(TypeError, match="already scales"):
        mp.LossScaleOptimizer(mp.LossScaleOptimizer(optax.sgd(1.0)))
    chained = mp.LossScaleOptimizer(optax.chain(mp.LossScaleOptimizer(optax.sgd(1.0)), optax.sgd(1.0)))
    with pytest.raises(TypeError, match="two loss scales"):
        chained.init(jnp.ones(3))
    siblings = optax.chain(mp.LossScaleOptimizer(optax.sgd(1.0)), mp.LossScaleOptimizer(optax.sgd(1.0)))
    state = siblings.init(jnp.ones(3))
    for run in (lambda f: f(), lambda f: require_module("jax").jit(f)()):
        with pytest.raises(TypeError, match="another mixedpolicy LossScaleOptimizer"):
            run(lambda: siblings.update(jnp.ones(3), state, jnp.ones(3)))
    opt = mp.LossScaleOptimizer(optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2))
    with require_module("jax").numpy_dtype_promotion("standard"):  # optax's own mixing
        w, _ = _optax_step(opt, jnp.ones(3, jnp.float32))
    np.testing.assert_array_equal(np.asarray(w), np.ones(3, np.float32))  # accumulating


# -- torch -------------------------------------------------------------------------
def _torch_setup(loss_scale=None):
    torch = require_module("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    kwargs = {} if loss_scale is None else {"loss_scale": loss_scale}
    return torch, model, mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_torch_double_wrapping_is_refused():
    torch, model, opt = _torch_setup()
    with pytest.raises(TypeError, match="already scales"):
        mp.LossScaleOptimizer(opt)


def test_torch_reads_as_a_grad_scaler_and_a_gradient_penalty_works_as_in_torchs_recipe():
    """GradScaler's getters (loggers and recipes read them), and torch's gradient-penalty recipe:
    grads of the scaled loss by autograd.grad, unscaled by 1 / get_scale()."""
    torch, model, opt = _torch_setup(mp.DynamicLossScale(8.0, dynamic_growth_steps=3))
    assert (opt.is_enabled(), opt.get_scale(), opt.get_growth_factor(), opt.get_backoff_factor(),
            opt.get_growth_interval()) == (True, 8.0, 2.0, 0.5, 3)
    x = torch.randn(5, 4)
    loss = model(x).pow(2).mean()
    scaled = torch.autograd.grad(opt.scale_loss(loss), list(model.parameters()), create_graph=True)
    penalty = sum((g / opt.get_scale()).pow(2).sum() for g in scaled)
    expected = torch.autograd.grad(loss + penalty, list(model.parameters()), retain_graph=True)
    opt.scale_loss(loss + penalty).backward()
    with pytest.raises(ValueError, match=r"unscale_\(SGD\), an optimizer that this LossScaleOptimizer over \['SGD'\] does not wrap"):
        opt.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))  # not the one it wraps
    opt.unscale_(opt.inner_optimizer)  # GradScaler's spelling names the optimizer
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g)
    opt.step(opt.inner_optimizer)  # GradScaler's step(optimizer)
    opt.update()  # GradScaler's loop calls it after step: the scale already moved
    assert opt.num_skipped_steps == 0 and opt.get_scale() == 8.0
    opt.update(torch.tensor([64.0]))  # GradScaler's update(new_scale): set, the counter kept
    assert opt.get_scale() == 64.0 and opt.scaler_state_dict()["_growth_tracker"] == 1
    with pytest.raises(ValueError, match="new_scale=0.0; expected a finite number > 0"):
        opt.update(0.0)
    _, _, plain = _torch_setup(mp.NoLossScale())
    assert (plain.is_enabled(), plain.get_scale()) == (False, 1.0)
    plain.update(4.0)  # ignored, as a disabled GradScaler ignores it
    assert plain.get_scale() == 1.0


def test_torch_no_loss_scale_skips_and_survives_its_state_dict():
    torch, model, opt = _torch_setup(mp.NoLossScale())
    before = model.weight.detach().clone()
    opt.scale_loss(model(torch.ones(2, 4)).sum() * float("inf")).backward()
    opt.step()
    assert opt.last_step_skipped and torch.equal(model.weight, before)
    opt.load_state_dict(opt.state_dict())
    assert isinstance(opt._scale_settings, mp.NoLossScale)
    assert opt.scale_loss(torch.tensor(3.0)).item() == 3.0


@pytest.mark.parametrize("steps_before", [0, 3])
def test_torch_half_parameters_after_wrapping_are_refused_at_step(steps_before):
    """As GradScaler refuses float16 gradients at every unscale: also after steps in float32,
    whose partition of the parameters by dtype the wrapper keeps from step to step."""
    torch, model, opt = _torch_setup()
    for _ in range(steps_before):
        opt.zero_grad()
        opt.scale_loss(model(torch.ones(2, 4)).sum()).backward()
        opt.step()
    model.half()
    opt.zero_grad()
    opt.scale_loss(model(torch.ones(2, 4, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(ValueError, match="float16 gradients"):
        opt.step()


def test_torch_add_param_group_checks_like_the_constructor():
    torch, model, opt = _torch_setup()
    with pytest.raises(ValueError, match="master weights"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))]})
    extra = torch.nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [extra]})
    assert opt.param_groups[-1]["params"] == [extra]
    head = torch.nn.Linear(2, 3)  # a generator, as users write it: read once, every parameter kept
    opt.add_param_group({"params": head.parameters(), "lr": 0.5})
    assert opt.param_groups[-1]["params"] == list(head.parameters()) and opt.param_groups[-1]["lr"] == 0.5
    half = torch.nn.Linear(2, 2).half()
    with pytest.raises(ValueError, match="master weights"):
        opt.add_param_group({"params": half.parameters()})
    for bad in ({}, None, "params"):
        with pytest.raises(TypeError, match="expected a dict with 'params'"):
            opt.add_param_group(bad)
    assert len(opt.param_groups) == 3  # nothing refused was added
    a, b = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])
    with pytest.raises(TypeError, match="inner_optimizers"):
        mp.LossScaleOptimizer([a, b]).add_param_group({"params": [extra]})


def test_torch_step_without_gradients_is_refused_not_counted():
    torch, model, opt = _torch_setup(mp.DynamicLossScale(8.0, dynamic_growth_steps=1))
    with pytest.raises(RuntimeError, match="no gradients"):
        opt.step()
    assert opt.loss_scale.item() == 8.0


def test_torch_step_and_state_dict_hooks_run():
    torch, model, opt = _torch_setup()
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load"))
    opt.scale_loss(model(torch.ones(2, 4)).sum()).backward()
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "sd", "load"]


def test_torch_optimizers_that_handle_amp_scaling_get_what_they_can_use():
    # torch's test_grad_scaler_pass_itself: an optimizer marked _step_supports_amp_scaling reads
    # grad_scale and found_inf set on it for the step (as torch's fused ones do); one whose step
    # takes GradScaler's older grad_scaler keyword is given none here, so its gradients must come
    # already unscaled (stepping on gradients 2**15 too large would train silently wrong)
    torch = require_module("torch")
    seen = {}

    class ReadsAttributes(torch.optim.Optimizer):
        _step_supports_amp_scaling = True

        def step(self, closure=None):
            seen["attributes"] = (float(self.grad_scale), float(self.found_inf))
            for p in self.param_groups[0]["params"]:  # unscales itself, skipping where found_inf says
                p.data.sub_(p.grad * (0.0 if self.found_inf else 0.1 / self.grad_scale))

    class TakesKeyword(torch.optim.Optimizer):
        _step_supports_amp_scaling = True

        def step(self, closure=None, *, grad_scaler=None):
            seen["keyword"] = (grad_scaler, hasattr(self, "grad_scale"), hasattr(self, "found_inf"))
            for p in self.param_groups[0]["params"]:
                p.data.sub_(0.1 * p.grad)

    for cls in (ReadsAttributes, TakesKeyword):
        p = torch.nn.Parameter(torch.ones(2))
        opt = mp.LossScaleOptimizer(cls([p], {}), policy="mixed_float16")
        opt.scale_loss((2 * p).sum()).backward()
        opt.step()
        torch.testing.assert_close(p.detach(), torch.full((2,), 0.8))  # 1 - 0.1 * 2, unscaled either way
        assert not hasattr(opt.inner_optimizer, "grad_scale") and not hasattr(opt.inner_optimizer, "found_inf")
    assert seen == {"attributes": (2.0 ** 15, 0.0), "keyword": (None, False, False)}


def test_torch_wrapper_pickles_and_deep_copies():
    torch, model, opt = _torch_setup()
    for clone in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        assert len(clone.inner_optimizers) == 1 and clone.loss_scale.item() == opt.loss_scale.item()


def test_torch_scale_loss_takes_lists_and_refuses_numbers():
    torch, model, opt = _torch_setup()
    a, b = opt.scale_loss([torch.tensor(1.0), torch.tensor(2.0)])
    assert a.item() == 2.0**15 and b.item() == 2.0**16
    with pytest.raises(TypeError, match="loss tensor"):
        opt.scale_loss(3.0)


def test_torch_state_of_another_optimizer_count_is_refused_and_nothing_loads():
    torch = require_module("torch")
    ps = [torch.nn.Parameter(torch.ones(1)) for _ in range(3)]
    two = mp.LossScaleOptimizer([torch.optim.SGD([p], lr=0.1) for p in ps[:2]])
    three = mp.LossScaleOptimizer([torch.optim.SGD([p], lr=0.5) for p in ps])
    one = mp.LossScaleOptimizer(torch.optim.SGD([ps[0]], lr=0.5))
    with pytest.raises(ValueError, match="over 2 optimizer"):
        three.load_state_dict(two.state_dict())
    assert [g["lr"] for g in three.param_groups] == [0.5] * 3
    with pytest.raises(ValueError, match="over 1 optimizer"):
        three.load_state_dict(one.state_dict())
    with pytest.raises(ValueError, match="over 2 optimizer"):
        one.load_state_dict(two.state_dict())


@pytest.mark.parametrize("backend", ["numpy", "jax", "torch"])
def test_select_tree_keeps_the_old_tree_after_a_non_finite_step_as_jmps_does(backend):
    """jmp's loop: unscale, all_finite, adjust, select_tree(finite, new, old); in the trees'
    framework, under jit too; the flag and the two trees checked."""
    if backend == "numpy":
        xp, flag = np, np.bool_
    elif backend == "jax":
        xp = require_module("jax").numpy
        flag = xp.bool_
    else:
        torch = require_module("torch")
        xp, flag = torch, (lambda v: torch.tensor(v))
    new, old = {"w": xp.ones(2), "n": None, "c": [xp.ones(3)]}, {"w": xp.zeros(2), "n": None, "c": [xp.zeros(3)]}
    for finite, expected in ((True, 1.0), (False, 0.0)):
        picked = mp.select_tree(flag(finite), new, old)
        assert picked["n"] is None and float(picked["w"][0]) == float(picked["c"][0][2]) == expected
    assert mp.select_tree(True, new, old) is new and mp.select_tree(mp.all_finite({"g": float("nan")}), new, old)["w"].sum() == 0
    if backend == "jax":
        jax = require_module("jax")
        assert float(jax.jit(mp.select_tree)(flag(False), new, old)["w"][1]) == 0.0
    with pytest.raises(TypeError, match=r"Received pred=.*expected boolean scalar"):
        mp.select_tree(xp.ones(1), new, old)
    with pytest.raises(ValueError, match=r"shapes \(2,\) and \(3,\)"):
        mp.select_tree(flag(True), {"w": xp.ones(2)}, {"w": xp.ones(3)})
    with pytest.raises(ValueError, match="trees of 1 and 2 leaves"):
        mp.select_tree(flag(True), {"w": xp.ones(2)}, {"w": xp.ones(2), "b": xp.ones(2)})


@pytest.mark.parametrize("backend", ["numpy", "jax", "torch"])
def test_cast_to_full_and_half_are_jmps_on_every_frameworks_trees(backend):
    """jmp's test_cast_to_full / test_cast_to_half: floating leaves cast, integers and objects
    kept; the half dtype is float16 off a TPU (jmp's half_dtype), bfloat16 on one."""
    if backend == "numpy":
        xp = np
    elif backend == "jax":
        xp = require_module("jax").numpy
    else:
        xp = require_module("torch")
    half = mp.half_dtype()
    on_tpu = backend == "jax" and require_module("jax").local_devices()[0].platform == "tpu"
    assert half == ("bfloat16" if on_tpu else "float16") and isinstance(half, str)
    with pytest.raises(TypeError, match=r"half_dtype\('tpu'\).*tree of arrays"):
        mp.half_dtype("tpu")  # a platform's name is not a tree of arrays on it
    o = object()
    tree = {"o": o, "h": xp.ones((), dtype=xp.float16), "f": xp.ones((), dtype=xp.float32),
            "i": xp.ones((), dtype=xp.int16)}
    full = mp.cast_to_full(tree)
    assert full["o"] is o and full["h"].dtype == xp.float32 and full["f"].dtype == xp.float32
    assert full["i"].dtype == xp.int16 and float(full["h"]) == 1.0
    halved = mp.cast_to_half(tree)
    assert mp.half_dtype(tree) == halved["f"].dtype == halved["h"].dtype and halved["i"].dtype == xp.int16
    assert halved["o"] is o and type(mp.cast_to_half([1.5])[0]) is float  # a Python number is not an array
    assert type(mp.Policy("mixed_bfloat16").cast_to_compute({"lr": 1e-3, "w": xp.ones(())})["lr"]) is float


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax", "tensorflow"])
def test_select_tree_refuses_trees_of_as_many_leaves_under_other_keys(backend):
    """{"a": new} against {"b": old} has one leaf each: it was picked leaf for leaf, the old
    values landing under the new keys; jmp (JAX's tree_map) refuses it, and so does this."""
    xp = pytest.importorskip({"numpy": "numpy", "torch": "torch", "jax": "jax.numpy",
                              "tensorflow": "tensorflow"}[backend])
    flag = xp.constant(False) if backend == "tensorflow" else xp.asarray(False)
    with pytest.raises(ValueError, match=r"two structures.*\bthe same keys and nesting"):
        mp.select_tree(flag, {"a": xp.ones(2)}, {"b": xp.ones(2)})
    with pytest.raises(ValueError, match="two structures"):
        mp.select_tree(flag, [xp.ones(2)], (xp.ones(2),))
    assert list(mp.select_tree(flag, {"a": [xp.ones(2)]}, {"a": [xp.ones(2)]})) == ["a"]


def test_torch_step_closure_under_scaling_scales_a_backward_it_did_not_scale_once():
    # a closure called once by step(closure) (torch's optimizers, Lightning): its backward of the
    # loss runs on the scaled loss and is unscaled at once, as scale_loss(...).backward() and
    # unscale_() by hand; a closure that scales itself is not scaled twice
    torch = require_module("torch")
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.randn(8, 3)

    def run(scales_itself):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy="mixed_float16")
        seen = []

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y) * (float("inf") if len(seen) == 1 else 1.0)
            (opt.scale_loss(loss) if scales_itself else loss).backward()
            seen.append(float(model.weight.grad.abs().max()))
            return loss

        for _ in range(3):
            opt.step(closure)
        return model.weight.detach().clone(), opt, seen

    (w_own, opt_own, seen_own), (w_ours, opt_ours, seen_ours) = run(True), run(False)
    torch.testing.assert_close(w_ours, w_own)
    assert opt_ours.num_skipped_steps == opt_own.num_skipped_steps == 1
    assert opt_ours.get_scale() == opt_own.get_scale() == 2.0**14
    # the closure's own code saw true gradients (Lightning clips there); scale_loss's are scaled
    assert seen_ours[0] < 100 < seen_own[0]
