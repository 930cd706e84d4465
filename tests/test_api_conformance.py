"""Regressions from the conformance review: nonsense refused, dispatch and names that hold."""

import gc
import importlib
import weakref

import pytest

from conftest import require_module

import mixedpolicy as mp


def test_an_empty_config_and_a_self_contradicting_one_are_refused():
    with pytest.raises(ValueError, match="names no policy"):
        mp.Policy.from_config({})
    with pytest.raises(ValueError, match="contradicts"):
        mp.Policy.from_config({"name": "mixed_float16", "compute_dtype": "bfloat16"})
    assert mp.Policy.from_config({"compute_dtype": "bfloat16"}) == mp.Policy("mixed_bfloat16")
    keras_form = {"module": "keras", "class_name": "DTypePolicy", "config": {"name": "mixed_bfloat16"}}
    assert mp.Policy.from_config(keras_form) == mp.Policy("mixed_bfloat16")


@pytest.mark.parametrize("value", ["float", float, " Float "])
def test_float_without_a_width_is_refused_as_ambiguous(value):
    with pytest.raises(ValueError, match="ambiguous.*float32.*float64"):
        mp.Policy(compute_dtype=value)


def test_a_huge_name_is_not_echoed_whole():
    with pytest.raises(ValueError) as info:
        mp.Policy("x" * 1_000_000)
    assert len(str(info.value)) < 1000 and "1000002 characters" in str(info.value)


@pytest.mark.parametrize("key", ["[", "layers.[z-a]", "a[!"])
def test_broken_globs_are_refused(key):
    with pytest.raises(ValueError, match="Received override key"):
        mp.PolicyMap("float32", {key: "float32"})


def test_escaped_brackets_and_ranges_are_accepted():
    mp.PolicyMap("float32", {"layers.[0-3].norm": "float32", "x.[[]": "float16"})


@pytest.mark.parametrize("key", [int, str, object])
def test_builtin_types_are_no_layer_classes(key):
    with pytest.raises(TypeError, match="built-in type"):
        mp.PolicyMap("float32", {key: "float32"})


def test_module_names_do_not_clash_with_the_functions():
    assert importlib.import_module("mixedpolicy.table").PolicyTable is mp.PolicyTable
    import mixedpolicy.scope as scope

    assert scope.global_policy is mp.global_policy
    assert callable(mp.describe) and callable(mp.global_policy)


def test_isinstance_works_before_any_wrapper_was_made_by_the_factory():
    torch = require_module("torch")
    from mixedpolicy.backends.torch.optimizer import TorchLossScaleOptimizer

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])
    assert isinstance(TorchLossScaleOptimizer(opt, mp.DynamicLossScale()), mp.LossScaleOptimizer)
    assert not isinstance(opt, mp.LossScaleOptimizer)
    assert issubclass(TorchLossScaleOptimizer, mp.LossScaleOptimizer)
    assert not issubclass(torch.optim.SGD, mp.LossScaleOptimizer) and not issubclass(int, mp.LossScaleOptimizer)


def test_loss_scale_optimizer_is_an_abstract_base_class_one_can_register_with():
    import abc

    class OwnWrapper:  # a wrapper of one's own, for a framework mixedpolicy does not know
        pass

    assert isinstance(mp.LossScaleOptimizer, abc.ABCMeta) and not isinstance(OwnWrapper(), mp.LossScaleOptimizer)
    mp.LossScaleOptimizer.register(OwnWrapper)
    assert isinstance(OwnWrapper(), mp.LossScaleOptimizer) and issubclass(OwnWrapper, mp.LossScaleOptimizer)
    with pytest.raises(TypeError, match="OwnWrapper"):  # the factory still only wraps what it knows
        mp.LossScaleOptimizer(OwnWrapper())


def test_a_refused_list_does_not_poison_the_dispatch_of_lists():
    torch = require_module("torch")
    with pytest.raises(TypeError):
        mp.LossScaleOptimizer([])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])
    assert len(mp.LossScaleOptimizer([opt]).inner_optimizers) == 1


def test_the_dispatch_cache_keeps_no_class_alive():
    torch = require_module("torch")

    cls = type("Made", (torch.nn.Module,), {})
    mp.describe(cls())
    ref = weakref.ref(cls)
    del cls
    gc.collect()
    assert ref() is None


def test_huge_keys_and_values_are_cut_short_in_map_errors():
    with pytest.raises(ValueError) as info:
        mp.PolicyMap("float32", {"k" * 1_000_000 + "[": "float32"})
    assert len(str(info.value)) < 1000
    with pytest.raises((TypeError, ValueError)) as info:
        mp.PolicyMap("float32", {"head": "x" * 1_000_000})
    assert len(str(info.value)) < 1000


def test_a_quantized_keras_policy_is_refused_not_stripped():
    """Keras's int8/float8 policies carry quantization a Policy cannot: refused, not read as
    their source policy."""
    class Quantized:  # the fields of keras's QuantizedDTypePolicy, without importing Keras
        name, variable_dtype, compute_dtype = "int8_from_mixed_bfloat16", "float32", "bfloat16"
        quantization_mode = "int8"

    with pytest.raises(ValueError, match="quantized Keras policy 'int8_from_mixed_bfloat16'"):
        mp.Policy.from_keras(Quantized())
    with pytest.raises(ValueError, match="quantization_mode='int8'"):
        mp.set_global_policy(Quantized())
    assert mp.global_policy() == mp.Policy("float32")
    # Keras's names for integer weights, given as a policy name: the Keras recipe in the message
    for name, mode, source in [("int8_from_mixed_bfloat16", "int8", "mixed_bfloat16"),
                               ("int4/128_from_float32", "int4", "float32"), ("gptq_from_bfloat16", "gptq", "bfloat16")]:
        with pytest.raises(ValueError, match=rf"model.quantize\('{mode}'\)\) and apply the policy .*'{source}'"):
            mp.Policy(name)


def test_an_array_is_no_dtype_even_where_numpy_would_read_it_as_one():
    # numpy's dtype() reads any object with a .dtype (a JAX array, a numpy scalar) as that dtype,
    # so Policy(x) took a JAX array's dtype where a numpy array was refused.
    jnp = require_module("jax.numpy", "jax")
    np = require_module("numpy")
    for value in (jnp.zeros(2, jnp.float16), np.float16(1.0), np.zeros(3, np.float16)):
        with pytest.raises(TypeError, match="Received policy name"):
            mp.Policy(value)
        with pytest.raises(TypeError, match=r"an array of type .* shape .*pass its \.dtype"):
            mp.Policy(compute_dtype=value)
    assert mp.Policy(jnp.zeros(2, jnp.float16).dtype) == mp.Policy(np.float16) == mp.Policy("float16")


def test_counts_candidates_and_models_that_are_not_what_they_name_are_refused():
    # wire_bytes took any number (a float gave a float, None a TypeError of its own arithmetic);
    # AdaPrec("float32") took the string letter by letter; a pytree with no arrays reached jax.grad
    from mixedpolicy.codecs import wire_bytes

    for bad in (-1, 1.5, True, None, "3"):
        with pytest.raises(TypeError, match=r"Received numel=.*whole number >= 0"):
            wire_bytes(bad, "float32")
    assert wire_bytes(10, "bfloat16") == 20
    for bad in ([], None, 16):  # a list raised "unhashable type: 'list'"
        with pytest.raises(TypeError, match=r"Received reduce_dtype=.* of type .*expected one of"):
            wire_bytes(10, bad)
    with pytest.raises(ValueError, match=r"Received reduce_dtype='int8'.*expected one of"):
        wire_bytes(10, "int8")
    for bad in ("float32", None, 3):
        with pytest.raises(TypeError, match=r"Received candidates=.*iterable of reduce choices"):
            mp.AdaPrec(bad, bytes_per_step=lambda choice: 1)
    jax = require_module("jax")
    for bad in (None, {"a": "text"}, [object()]):
        with pytest.raises(TypeError, match=r"no floating array among its leaves"):
            mp.inspect_gradients(bad, lambda params, batch: 0.0, [1])
    torch = require_module("torch")
    with pytest.raises(TypeError, match=r"expected a pytree of arrays"):
        mp.jax.bytes_per_step({"w": torch.zeros(2)})
    assert mp.jax.bytes_per_step({"w": jax.numpy.zeros(2)}, "float32") == 8
    with pytest.raises(TypeError, match=r"Received .*expected a torch.nn.Module"):
        mp.torch.bytes_per_step({"w": torch.zeros(2)})


def test_optax_wrappers_refuse_what_is_no_gradient_loss_or_state_dtype():
    # a string among the gradients reached the unscale's arithmetic ("can't multiply sequence");
    # a string loss reached jnp.asarray; state_storage took any dtype numpy could read, and no
    # optimizer at all failed on its missing .init
    jnp = require_module("jax.numpy", "jax")
    optax = require_module("optax")
    params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2)}
    opt = mp.LossScaleOptimizer(optax.adam(1e-3), policy="mixed_float16")
    with pytest.warns(UserWarning, match="Received bfloat16 parameters .* storing its variables in float32"):
        state = opt.init(params)  # (half weights the policy does not store: said, as torch refuses them)
    for bad, where in (({"w": "x", "b": jnp.ones(2)}, r"\['w'\]"), ("nonsense", "the root"),
                       ({"w": object(), "b": jnp.ones(2)}, r"\['w'\]")):
        with pytest.raises(TypeError, match=rf"Received gradients with a leaf of type .* at {where}; expected"):
            opt.update(bad, state, params)
    jax = require_module("jax")  # an integer leaf's float0 gradient: named, with the fix
    float0 = jax.grad(lambda p: p["b"].sum() * p["n"].astype("float32"), allow_int=True)({"b": jnp.ones(2), "n": jnp.int32(2)})
    with pytest.raises(TypeError, match=r"at \['n'\], the float0 gradient of an integer leaf .*differentiate"):
        opt.update(float0, opt.init({"b": jnp.ones(2), "n": jnp.int32(2)}), None)
    for loss in ("1.0", None, object(), [1.0]):
        with pytest.raises(TypeError, match="Received a loss of type .*expected the scalar loss"):
            opt.scale_loss(loss, state)
    assert float(opt.scale_loss(jnp.bfloat16(2), state)) == 2 * 2.0 ** 15
    for dtype in ("int8", "nonsense", ""):
        with pytest.raises(ValueError, match=r"Received dtype=.*expected the dtype the moments"):
            mp.jax.state_storage(optax.adam(1e-3), dtype)
    for dtype in (None, 0, 1.5, True):
        with pytest.raises(TypeError, match=r"Received dtype=.*expected the dtype the moments"):
            mp.jax.state_storage(optax.adam(1e-3), dtype)
    with pytest.raises(TypeError, match=r"Received str .*expected an optax GradientTransformation"):
        mp.jax.state_storage("adam", "bfloat16")
    assert mp.jax.state_storage(optax.adam(1e-3), jnp.bfloat16).init(params)[0].mu["b"].dtype == jnp.bfloat16
