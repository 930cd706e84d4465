"""apply_policy, describe and LossScaleOptimizer: dispatch, plain functions, errors."""

import numpy as np
import pytest

import mixedpolicy as mp
from mixedpolicy import _registry


def test_function_policy_casts_in_and_out():
    seen = {}

    def f(params, x, n):
        seen.update(w=params["w"].dtype, x=x.dtype, n=n.dtype)
        return params["w"] * x

    g = mp.apply_policy(f, "p=f32,c=f16,o=f32")
    out = g({"w": np.float32(2.0)}, np.ones(3, np.float32), np.arange(3, dtype=np.int32))
    assert seen == {"w": np.float16, "x": np.float16, "n": np.int32}  # ints never cast
    assert out.dtype == np.float32
    assert g.__name__ == "f"


def test_function_policy_defaults_to_the_global_policy_at_apply_time():
    mp.set_global_policy("mixed_bfloat16")
    g = mp.apply_policy(lambda x: x)
    mp.set_global_policy("float32")
    assert _registry.array_ops("numpy").floating_dtype(g(np.ones(2, np.float32))) == "bfloat16"
    assert mp.describe(g)[0].source == "global policy"


def test_float32_policy_is_bit_for_bit():
    rng = np.random.default_rng(0)
    w, x = rng.normal(size=(8, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)
    f = lambda w, x: np.tanh(w @ x)  # noqa: E731
    assert np.array_equal(mp.apply_policy(f, "float32")(w, x), f(w, x))


def test_describe_a_function():
    g = mp.apply_policy(lambda x: x, "mixed_float16")
    (row,) = mp.describe(g)
    assert (row.path, row.variable_dtype, row.compute_dtype, row.source) == \
        ("", "float32", "float16", "map default")
    assert "(root)" in str(mp.describe(g)) and "| `(root)` |" in mp.describe(g).to_markdown()


def test_a_policy_function_built_directly_takes_what_apply_policy_takes_and_refuses_the_rest():
    f = mp.PolicyFunction(lambda w, x: w * x, "mixed_float16")
    assert f(np.float32(2.0), np.ones(2, np.float32)).dtype == np.float16
    assert mp.PolicyFunction(f.fn, mp.Policy("float32")).policy == mp.Policy("float32")
    with pytest.raises(TypeError, match="expected a callable f"):
        mp.PolicyFunction(None, "float32")
    with pytest.raises(TypeError, match="expected a Policy"):
        mp.PolicyFunction(print, 5)
    with pytest.raises(ValueError, match="'nonsense'"):
        mp.PolicyFunction(print, "nonsense")


def test_overrides_on_a_plain_function_are_an_error():
    with pytest.raises(TypeError, match="no layers to match"):
        mp.apply_policy(lambda x: x, "float32", {"fc": "float16"})


@pytest.mark.parametrize("model", [object(), 3, "model", int])
def test_unsupported_models_name_the_type(model):
    with pytest.raises(TypeError, match=f"type .*{type(model).__qualname__}.*no installed mixedpolicy adapter"):
        mp.apply_policy(model, "float32")
    with pytest.raises(TypeError, match="no installed mixedpolicy adapter"):
        mp.describe(model)
    if isinstance(model, type):  # a class where its instance was meant: the fix names it
        with pytest.raises(TypeError, match=r"builtins.int is a class: build the model first, int\(...\)"):
            mp.apply_policy(model, "float32")


def test_unsupported_optimizer_names_the_type():
    with pytest.raises(TypeError, match=r"optimizer of type builtins.object.*Expected one of"):
        mp.LossScaleOptimizer(object())


def test_optimizer_arguments_that_belong_inside_are_rejected():
    with pytest.raises(TypeError, match=r"\['learning_rate'\].*belong to the inner optimizer"):
        mp.LossScaleOptimizer(object(), learning_rate=0.1)


def test_another_librarys_name_for_a_setting_is_refused_with_ours():
    # GradScaler's and jmp's spellings: the refusal names the setting they mean here
    with pytest.raises(TypeError, match=r"for growth_interval= pass dynamic_growth_steps= \(GradScaler's"):
        mp.LossScaleOptimizer(object(), growth_interval=100)
    with pytest.raises(TypeError, match=r"for init_scale= pass initial_scale=.*for min_loss_scale= pass min_scale="):
        mp.LossScaleOptimizer(object(), init_scale=2.0, min_loss_scale=1.0)
    with pytest.raises(TypeError, match=r"for enabled= pass loss_scale=mp.NoLossScale\(\)"):
        mp.LossScaleOptimizer(object(), enabled=False)


def test_bad_loss_scale_settings_fail_before_dispatch():
    with pytest.raises(ValueError, match="initial_scale=0.0; expected a finite number > 0"):
        mp.LossScaleOptimizer(object(), initial_scale=0)
    with pytest.raises(TypeError, match="DynamicLossScale, StaticLossScale or NoLossScale"):
        mp.LossScaleOptimizer(object(), loss_scale=128.0)


def test_policy_cast_helpers():
    p = mp.Policy("p=f32,c=bf16,o=f16")
    tree = {"a": np.ones(2, np.float32), "i": np.ones(2, np.int64)}
    numpy = _registry.array_ops("numpy")
    assert numpy.floating_dtype(p.cast_to_compute(tree)["a"]) == "bfloat16"
    assert p.cast_to_output(tree)["a"].dtype == np.float16
    assert p.cast_to_param(p.cast_to_compute(tree))["a"].dtype == np.float32
    assert p.cast_to_compute(tree)["i"].dtype == np.int64


def test_a_policy_table_takes_layer_policy_rows_only():
    import mixedpolicy as mp

    row = mp.LayerPolicy("fc", "Linear", mp.Policy("mixed_bfloat16"), "global policy")
    assert len(mp.PolicyTable([row])) == 1 and len(mp.PolicyTable()) == 0
    for rows, says in ((None, "rows of type NoneType"), ("fc", "rows of type str"), ([row, 3], "a row of type int")):
        with pytest.raises(TypeError, match=says):
            mp.PolicyTable(rows)
