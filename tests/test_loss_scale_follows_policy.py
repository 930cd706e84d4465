"""LossScaleOptimizer(opt) follows the policy: dynamic scaling where something computes in
float16, else no scaling with the same safety (a non-finite step is skipped);
``skip_nonfinite=False`` makes a pass-through that adds nothing to the inner optimizer's step.

(Keras: tests/backends/keras/suite/test_optimizer.py, under each Keras backend.)
"""

import numpy as np
import pytest

from conftest import require_module

import mixedpolicy as mp

PASS = "no scaling; a step whose gradients are not all finite is skipped"  # what a policy without float16 picks
EXACT = "pass-through"  # skip_nonfinite=False


def _torch_model(torch, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


# -- the choice ------------------------------------------------------------------------
def test_torch_follows_the_policies_apply_policy_put_on_its_parameters():
    torch = require_module("torch")

    def choice(model, **kw):
        return mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kw).loss_scaling

    assert choice(_torch_model(torch)).startswith(PASS)  # plain float32 model, float32 global
    assert choice(mp.apply_policy(_torch_model(torch), "mixed_bfloat16")).startswith(PASS)
    half = mp.apply_policy(_torch_model(torch), "mixed_float16")
    assert choice(half).startswith("dynamic")
    # one float16 layer in a bfloat16 model is enough
    assert choice(mp.apply_policy(_torch_model(torch), "mixed_bfloat16", {"2": "mixed_float16"})).startswith("dynamic")
    # the parameters' policies win over the global policy, both ways
    mp.set_global_policy("mixed_float16")
    assert choice(mp.apply_policy(_torch_model(torch), "float32")).startswith(PASS)
    mp.set_global_policy("float32")
    assert choice(half).startswith("dynamic")
    # removed policy: the parameters no longer carry one; the global policy decides
    assert choice(mp.remove_policy(half)).startswith(PASS)
    # what the user says wins: policy=, any scale setting, a ready loss scale
    assert choice(half, policy="mixed_bfloat16").startswith(PASS)
    assert choice(_torch_model(torch), policy="mixed_float16").startswith("dynamic")
    assert choice(_torch_model(torch), policy=mp.PolicyMap("float32", {"0": "mixed_float16"})).startswith("dynamic")
    assert choice(_torch_model(torch), dynamic_growth_steps=10).startswith("dynamic")
    assert choice(_torch_model(torch), loss_scale=mp.StaticLossScale(8.0)).startswith("static")
    assert choice(_torch_model(torch), skip_nonfinite=False).startswith(EXACT)


def test_a_copied_or_reloaded_model_carries_its_policy_to_the_optimizer():
    """copy.deepcopy (a fresh model per run, an EMA or teacher copy) makes new parameters without
    the marks apply_policy put on the originals; the copy's optimizer still follows its policy,
    layer by layer, and so does a model saved whole and loaded back."""
    torch = require_module("torch")
    import copy
    import io

    model = mp.apply_policy(_torch_model(torch), "mixed_bfloat16", {"2": "mixed_float16"})
    for twin in (copy.deepcopy(model), copy.deepcopy(copy.deepcopy(model))):
        assert all(a is not b for a, b in zip(model.parameters(), twin.parameters()))
        opt = mp.LossScaleOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1))
        assert opt.loss_scaling.startswith("dynamic")  # the float16 head came along
        head = mp.LossScaleOptimizer(torch.optim.SGD(twin[0].parameters(), lr=0.1))
        assert head.loss_scaling.startswith(PASS)  # the bfloat16 layer alone
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for twin in (loaded, copy.deepcopy(loaded)):
        assert mp.LossScaleOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1)).loss_scaling.startswith("dynamic")
    # a copy's policy removed: its parameters carry none; the original keeps its own
    twin = mp.remove_policy(copy.deepcopy(model))
    assert mp.LossScaleOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1)).loss_scaling.startswith(PASS)
    assert mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)).loss_scaling.startswith("dynamic")


def test_without_a_view_of_the_model_its_arguments_and_the_global_policy_decide():
    """No action at a distance: a float16 model alive elsewhere does not change the choice. It
    makes a wrapper that scales nothing, made without a policy, warn with the fix: an optax
    transformation cannot see that its model computes in float16."""
    import gc
    import warnings

    jax = require_module("jax")
    optax = require_module("optax", "jax")
    nnx = require_module("flax.nnx", "jax")
    linen = require_module("flax.linen", "jax")

    def choice(**kw):
        return mp.LossScaleOptimizer(optax.sgd(0.1), **kw).loss_scaling

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choice().startswith(PASS)
        with mp.policy_scope("mixed_float16"):
            assert choice().startswith("dynamic")
        bf16 = mp.apply_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "mixed_bfloat16")
        assert choice().startswith(PASS)  # no float16 anywhere: nothing to say
    model = mp.apply_policy(linen.Dense(2), "mixed_float16")
    f = mp.apply_policy(lambda w, x: w @ x, "mixed_float16")
    with pytest.warns(UserWarning, match=r"follows 'float32' .*scales nothing, while a model in this process "
                                         r"computes in float16 \(apply_policy gave PolicyFunction 'mixed_float16'\)"
                                         r".*policy=\.\.\."):
        assert choice().startswith(PASS)  # unrelated live float16 models decide nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choice(policy="mixed_float16").startswith("dynamic")  # the model's policy, said plainly
        assert choice(policy=mp.PolicyMap("float32", {"head": "mixed_float16"})).startswith("dynamic")
        assert choice(policy="float32").startswith(PASS)  # no scaling, meant
        assert choice(initial_scale=2.0**10).startswith("dynamic")
    with mp.policy_scope("mixed_bfloat16"), pytest.warns(UserWarning, match="follows 'mixed_bfloat16'"):
        assert choice().startswith(PASS)
    assert model is not None and f is not None and bf16 is not None and jax is not None
    del model, f
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the float16 models are gone
        assert choice().startswith(PASS)


def test_conflicting_or_bad_arguments_are_refused_with_the_fix():
    torch = require_module("torch")
    opt = torch.optim.SGD(_torch_model(torch).parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"together with \['initial_scale', 'policy'\].*one or the other"):
        mp.LossScaleOptimizer(opt, loss_scale=mp.NoLossScale(), initial_scale=8.0, policy="float32")
    with pytest.raises(TypeError, match="skip_nonfinite='yes'; expected True or False"):
        mp.LossScaleOptimizer(opt, skip_nonfinite="yes")
    with pytest.raises(ValueError, match="mixed_floatt"):
        mp.LossScaleOptimizer(opt, policy="mixed_floatt")
    with pytest.raises(TypeError, match="skip_nonfinite=3"):
        mp.NoLossScale(skip_nonfinite=3)
    assert mp.NoLossScale(False) != mp.NoLossScale() and mp.NoLossScale() == mp.NoLossScale(True)
    # skip_nonfinite=False where a scale is given would do nothing (a scale skips overflows): refused,
    # on every framework (the check is made before dispatch) and in a trainer's scale_settings
    with pytest.raises(TypeError, match=r"skip_nonfinite=False together with dynamic_growth_steps, initial_scale.*"
                                        r"would do nothing"):
        mp.LossScaleOptimizer(opt, initial_scale=8.0, dynamic_growth_steps=4, skip_nonfinite=False)
    with pytest.raises(TypeError, match=r"loss_scale=DynamicLossScale\(\.\.\.\)"):
        mp.LossScaleOptimizer(opt, loss_scale=mp.DynamicLossScale(), skip_nonfinite=False)
    with pytest.raises(TypeError, match=r"NoLossScale\(skip_nonfinite=True\), which says the opposite"):
        mp.LossScaleOptimizer(opt, loss_scale=mp.NoLossScale(), skip_nonfinite=False)
    with pytest.raises(TypeError, match="skip_nonfinite=False together with initial_scale"):
        from mixedpolicy.optimizer import check_trainer_scale_settings
        check_trainer_scale_settings({"initial_scale": 8.0, "skip_nonfinite": False}, "scale_settings")
    same = mp.LossScaleOptimizer(opt, loss_scale=mp.NoLossScale(skip_nonfinite=False), skip_nonfinite=False)
    assert same.loss_scaling.startswith(EXACT)  # (redundant, not contradictory)


# -- the pass-through adds nothing -----------------------------------------------------
def _aten_ops(torch, fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not str(func).startswith("profiler."):  # step-hook markers, not computation
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Count() as count:
        fn()
    return count.ops


@pytest.mark.parametrize("make", ["sgd", "adamw-foreach"])
def test_torch_pass_through_is_the_inner_step_bit_for_bit_and_op_for_op(make):
    torch = require_module("torch")
    build = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
             "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True)}[make]
    x, y = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), torch.randn(16, 2)
    ours_model, plain_model = _torch_model(torch), _torch_model(torch)
    mp.apply_policy(ours_model, "mixed_bfloat16")
    mp.apply_policy(plain_model, "mixed_bfloat16")
    ours = mp.LossScaleOptimizer(build(ours_model.parameters()), skip_nonfinite=False)
    plain = build(plain_model.parameters())
    assert ours.loss_scaling.startswith(EXACT)
    for _ in range(3):
        for model, opt in ((ours_model, ours), (plain_model, plain)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaled = ours.scale_loss(loss) if opt is ours else loss
            assert scaled is loss
            scaled.backward()
        ours.unscale_()  # nothing to unscale: a no-op, as GradScaler(enabled=False)'s
        ours_ops = _aten_ops(torch, ours.step)
        plain_ops = _aten_ops(torch, plain.step)
        assert ours_ops == plain_ops and ours_ops
    for a, b in zip(ours_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not ours.last_step_skipped and ours.num_skipped_steps == 0 and float(ours.loss_scale) == 1.0


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "bfloat16"])
def test_torch_never_applies_a_non_finite_step_unless_told_to(policy):
    torch = require_module("torch")
    for skip in (None, False, True):
        model = mp.apply_policy(_torch_model(torch), policy)
        kw = {} if skip is None else {"skip_nonfinite": skip}
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kw)
        (model(torch.ones(1, 4)).sum() * float("inf")).backward()
        opt.step()
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        assert finite == (skip is not False) and opt.last_step_skipped == (skip is not False)
        assert opt.num_skipped_steps == (skip is not False)


def test_optax_pass_through_is_the_inner_update_and_adds_no_operation():
    jax = require_module("jax")
    optax = require_module("optax", "jax")
    jnp = jax.numpy
    params = {"w": jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3), "b": jnp.ones(3, jnp.float32)}
    grads = jax.tree_util.tree_map(lambda p: p * 0.5 - 1.0, params)
    inner = optax.sgd(0.1, momentum=0.9)  # (adamw trips strict dtype promotion inside optax)
    opt = mp.LossScaleOptimizer(inner, skip_nonfinite=False)
    assert opt.loss_scaling.startswith(EXACT)
    state, inner_state = opt.init(params), inner.init(params)
    assert opt.scale_loss(jnp.float32(3.0), state) == 3.0

    def prims(fn, *args):
        return [e.primitive.name for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns]

    assert prims(lambda g, s, p: opt.update(g, s, p), grads, state, params) == \
        prims(lambda g, s, p: inner.update(g, s, p), grads, inner_state, params)
    ours, _ = jax.jit(opt.update)(grads, state, params)
    plain, _ = jax.jit(inner.update)(grads, inner_state, params)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(plain)):
        # the same operations (above); two compiled programs all the same, so within 2 ulp
        np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(b), maxulp=2)
    # the default: unscaled, but a non-finite update is skipped
    careful = mp.LossScaleOptimizer(inner)
    assert careful.loss_scaling == PASS
    bad = jax.tree_util.tree_map(lambda g: g * jnp.inf, grads)
    updates, new = careful.update(bad, careful.init(params), params)
    assert bool(new.last_step_skipped) and not any(bool(jnp.any(u)) for u in jax.tree_util.tree_leaves(updates))
    np.testing.assert_array_equal(np.asarray(new.loss_scale), 1.0)


def test_an_optax_pass_through_state_is_the_inner_state_alone_and_moves_between_policies():
    """Every array of a state costs on each jitted call (about 10 us under nnx.jit): a
    pass-through keeps none of its own, reads like a scaling state, and a state saved under
    one policy is adopted by a wrapper of another."""
    jax = require_module("jax")
    optax = require_module("optax", "jax")
    jnp = jax.numpy
    from mixedpolicy.backends.jax.optax import LossScaleState, PassThroughState

    params = {"w": jnp.ones((2, 3), jnp.float32)}
    grads = {"w": jnp.full((2, 3), 0.5, jnp.float32)}
    inner = optax.sgd(0.1, momentum=0.9)
    plain = mp.LossScaleOptimizer(inner, policy="float32", skip_nonfinite=False)
    state = plain.init(params)
    assert isinstance(state, PassThroughState)
    leaves = jax.tree_util.tree_leaves
    assert len(leaves(state)) == len(leaves(inner.init(params)))
    _, state = jax.jit(plain.update)(grads, state, params)
    assert mp.metrics(state) == {"loss_scale": 1.0, "skipped_steps": 0, "last_step_skipped": False}

    scaling = mp.LossScaleOptimizer(inner, policy="mixed_float16")
    # a checking or scaling wrapper keeps one int32 array of its own: the scale's bits and the counters
    for wrapper in (scaling, mp.LossScaleOptimizer(inner, policy="float32")):
        assert len(leaves(wrapper.init(params))) == len(leaves(inner.init(params))) + 1
    with pytest.raises(TypeError, match=r"Received a PassThroughState for a LossScaleOptimizer whose state is "
                                        r"a LossScaleState .*tx.adopt_state\(state\)"):
        scaling.update(grads, state, params)
    adopted = scaling.adopt_state(state)  # no scale was ever used: its own initial one
    assert isinstance(adopted, LossScaleState) and float(adopted.loss_scale) == 2.0**15
    np.testing.assert_array_equal(leaves(adopted.inner_state)[0], leaves(state.inner_state)[0])
    _, grown = scaling.update(grads, adopted.with_loss_scale(jnp.float32(64.0)), params)
    assert float(scaling.adopt_state(grown).loss_scale) == 64.0  # scaling to scaling: the scale kept
    static = mp.LossScaleOptimizer(inner, loss_scale=mp.StaticLossScale(8.0))
    assert float(static.adopt_state(grown).loss_scale) == 8.0  # a fixed scale keeps its own
    back = plain.adopt_state(grown)  # back to a policy that needs no scale
    assert isinstance(back, PassThroughState)
    np.testing.assert_array_equal(leaves(back)[0], leaves(grown.inner_state)[0])
    with pytest.raises(TypeError, match="Received a dict; expected the LossScaleState or PassThroughState"):
        plain.adopt_state({"w": 1})


def test_a_checkpoint_of_a_pass_through_loads_into_a_scaling_wrapper_and_back():
    """Switching the policy string between runs: the saved state moves both ways."""
    torch = require_module("torch")
    model = _torch_model(torch)
    plain = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters()))
    model(torch.ones(1, 4)).sum().backward()
    plain.step()
    scaling = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters()), policy="mixed_float16")
    scaling.load_state_dict(plain.state_dict())  # no scale was ever used: its own initial one
    assert float(scaling.loss_scale) == 2.0**15 and scaling.loss_scaling.startswith("dynamic")
    assert scaling.state_dict()["state"][0]["step"] == 1  # the inner state came along
    static = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters()), loss_scale=mp.StaticLossScale(256.0))
    scaling.load_state_dict(static.state_dict())  # a fixed scale: the start of the dynamic one
    assert float(scaling.loss_scale) == 256.0
    again = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters()))
    again.load_state_dict(scaling.state_dict())  # back to a policy that needs no scale
    assert again.loss_scaling.startswith(PASS) and float(again.loss_scale) == 1.0


# -- one loop, every policy ------------------------------------------------------------
@pytest.mark.parametrize("policy", ["float32", "32-true", "mixed_bfloat16", "bf16-mixed", "mixed_float16",
                                    "16-mixed", "bfloat16", "p=f32,c=bf16,o=f32", "float16", "16-true"])
def test_one_torch_loop_behaves_alike_under_every_policy_string(policy):
    """The same loop trains under every policy; what one policy refuses, every one refuses. Under
    a pure float16 policy the wrapper scales the float16 weights' gradients (the optax and Keras
    wrappers do the same): they are the policy's own, not half master weights by mistake."""
    torch = require_module("torch")
    model = mp.apply_policy(_torch_model(torch), policy)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.randn(8, 2)
    for step in range(4):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y) * (float("inf") if step == 1 else 1.0)
        opt.scale_loss(loss).backward()
        opt.unscale_()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(RuntimeError, match="already called"):
            opt.unscale_()
        opt.step()
    assert opt.num_skipped_steps == 1 and all(bool(torch.isfinite(p).all()) for p in model.parameters())
    # GradScaler's update(new_scale): set where it scales, checked and ignored where not (as a
    # disabled GradScaler ignores it)
    opt.update(2.0**10)
    assert opt.get_scale() == (2.0**10 if opt.is_enabled() else 1.0)
    with pytest.raises(ValueError, match="new_scale"):
        opt.update(float("nan"))
    # half master weights the policy does not store: refused under every policy, up front
    if mp.Policy(policy).variable_dtype == "float32":
        half = _torch_model(torch).half()
        with pytest.raises(ValueError, match="master weights"):
            mp.LossScaleOptimizer(torch.optim.SGD(half.parameters(), lr=0.1), policy=policy)
        with pytest.raises(ValueError, match="master weights"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, dtype=torch.float16))]})
    # zeroed in place, no backward: zero gradients, scaled or not; the inner step under every policy
    opt.zero_grad(set_to_none=False)
    opt.step()
    # a loop that forgets scale_loss: refused where the loss is scaled, harmless (scale 1) elsewhere
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x).float(), y).backward()
    if mp.Policy(policy).needs_loss_scaling:
        with pytest.raises(RuntimeError, match="no loss was scaled"):
            opt.step()
    else:
        opt.step()


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16", "bfloat16", "float16"])
def test_scale_settings_beside_a_policy_keep_its_own_half_weights_on_torch_as_on_optax(policy):
    """Scale settings choose the scale; the policy still says which half-precision weights are its
    own. Under a pure policy, `initial_scale=...` beside `policy=` was refused on torch as "half
    master weights" where the optax and Keras wrappers trained: adding a setting to a loop must
    not turn it into a refused one. Half weights a policy does not store stay refused."""
    torch = require_module("torch")
    settings = dict(initial_scale=2.0**10, dynamic_growth_steps=3)
    model = mp.apply_policy(_torch_model(torch), policy)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, **settings)
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.randn(8, 2)
    for step in range(5):  # skipped at 1 (1024 -> 512), grown back after three finite steps
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y) * (float("inf") if step == 1 else 1.0)
        opt.scale_loss(loss).backward()
        opt.step()
    assert opt.num_skipped_steps == 1 and opt.get_scale() == 2.0**10
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    # a scale given as it is: the parameters' own policies say the same
    mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=mp.DynamicLossScale(2.0**10))
    if mp.Policy(policy).variable_dtype == "float32":
        with pytest.raises(ValueError, match="master weights"):
            mp.LossScaleOptimizer(torch.optim.SGD(_torch_model(torch).half().parameters(), lr=0.1),
                                  policy=policy, **settings)
        with pytest.raises(ValueError, match="master weights"):
            mp.LossScaleOptimizer(torch.optim.SGD(_torch_model(torch).half().parameters(), lr=0.1),
                                  loss_scale=mp.DynamicLossScale(2.0**10))
    # the optax wrapper, given the same, on parameters in the policy's variable dtype
    jax = require_module("jax")
    optax = require_module("optax", "jax")
    jnp = jax.numpy
    params = {"w": jnp.full((4, 2), 0.5, mp.Policy(policy).variable_dtype)}
    tx = mp.LossScaleOptimizer(optax.sgd(0.1), policy=policy, **settings)
    state = tx.init(params)
    for step in range(5):
        grads = jax.grad(lambda p, f: tx.scale_loss(jnp.sum(p["w"].astype(jnp.float32) ** 2) * f, state))(
            params, jnp.float32(float("inf") if step == 1 else 1.0))
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert int(state.num_skipped_steps) == 1 and float(state.loss_scale) == 2.0**10
    assert bool(jnp.isfinite(params["w"]).all())


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16", "16-mixed", "bfloat16",
                                    "bf16-true", "float16", "16-true"])
def test_one_nnx_loop_behaves_alike_under_every_policy_string(policy):
    """The torch loop above, in Flax NNX with the optax wrapper: one jitted step trains under every
    policy (scaled where it computes in float16, float16 weights included), skips a non-finite
    step and counts it, and leaves every weight finite."""
    jax = require_module("jax")
    optax = require_module("optax", "jax")
    nnx = require_module("flax.nnx", "flax")
    jnp = jax.numpy
    model = mp.apply_policy(nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu,
                                           nnx.Linear(8, 2, rngs=nnx.Rngs(1))), policy)
    optimizer = nnx.Optimizer(model, mp.LossScaleOptimizer(optax.sgd(0.1), policy=policy), wrt=nnx.Param)
    x, y = jax.random.normal(jax.random.key(0), (8, 4)), jax.random.normal(jax.random.key(1), (8, 2))

    @nnx.jit
    def step(model, optimizer, factor):
        def loss_fn(model):
            loss = jnp.mean((model(x).astype(jnp.float32) - y) ** 2) * factor
            return optimizer.tx.scale_loss(loss, optimizer.opt_state), loss
        grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, jnp.float32(float("inf") if i == 1 else 1.0))) for i in range(6)]
    state = optimizer.opt_state
    assert int(state.num_skipped_steps) == 1 and losses[-1] < losses[0]
    # where it scales: the start, 2**15, halved once at the skipped step
    assert float(state.loss_scale) == (2.0**14 if mp.Policy(policy).needs_loss_scaling else 1.0)
    assert all(bool(jnp.isfinite(p).all()) for p in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))


def test_a_scaling_checkpoint_loads_into_a_wrapper_that_scales_nothing_and_says_so(caplog):
    torch = require_module("torch")
    import logging

    model = _torch_model(torch)
    scaling = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters()), policy="mixed_float16")
    scaling.scale_loss(model(torch.ones(1, 4)).sum() * float("inf")).backward()
    scaling.step()
    plain = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters()), policy="mixed_bfloat16")
    with caplog.at_level(logging.WARNING, logger="mixedpolicy"):
        plain.load_state_dict(scaling.state_dict())
    assert "loss scale is 16384" in caplog.text and "the scale is dropped" in caplog.text
    assert plain.loss_scaling.startswith("no scaling") and plain.num_skipped_steps == 1


def test_a_static_scale_keeps_its_own_on_torch_as_on_optax_and_what_is_dropped_is_said(caplog):
    """A checkpoint loaded into a wrapper with a static scale: the static scale stays (torch took
    the saved one, optax kept its own: one rule now), one warning says what was dropped; a state
    whose skip count a pass-through cannot keep says so too (optax dropped it silently)."""
    import logging

    torch = require_module("torch")
    model = _torch_model(torch)
    dynamic = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), initial_scale=64.0)
    dynamic.scale_loss(model(torch.ones(1, 4)).sum() * float("inf")).backward()
    dynamic.step()  # skipped: 64 -> 32
    static = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=mp.StaticLossScale(128.0))
    with caplog.at_level(logging.WARNING, logger="mixedpolicy"):
        static.load_state_dict(dynamic.state_dict())
    assert "loss scale is 32" in caplog.text and "static scale of 128" in caplog.text
    assert static.get_scale() == 128.0 and static.num_skipped_steps == 1
    caplog.clear()
    again = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=mp.StaticLossScale(128.0))
    with caplog.at_level(logging.WARNING, logger="mixedpolicy"):
        again.load_state_dict(static.state_dict())  # its own kind and scale: nothing to say
    assert caplog.text == "" and again.get_scale() == 128.0 and again.num_skipped_steps == 1

    jax = require_module("jax")
    optax = require_module("optax", "jax")
    jnp = jax.numpy
    params = {"w": jnp.ones(3)}
    tx = mp.LossScaleOptimizer(optax.sgd(0.1), initial_scale=64.0)
    _, state = tx.update({"w": jnp.full(3, jnp.inf)}, tx.init(params), params)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mixedpolicy"):
        kept = mp.LossScaleOptimizer(optax.sgd(0.1), loss_scale=mp.StaticLossScale(128.0)).adopt_state(state)
    assert "loss scale is 32" in caplog.text and "static scale of 128" in caplog.text
    assert float(kept.loss_scale) == 128.0 and int(kept.num_skipped_steps) == 1
    caplog.clear()
    checked = mp.LossScaleOptimizer(optax.sgd(0.1), policy="float32")
    _, counted = checked.update({"w": jnp.full(3, jnp.nan)}, checked.init(params), params)
    with caplog.at_level(logging.WARNING, logger="mixedpolicy"):
        mp.LossScaleOptimizer(optax.sgd(0.1), skip_nonfinite=False).adopt_state(counted)
    assert "counted 1 skipped steps" in caplog.text and "the count is dropped" in caplog.text
