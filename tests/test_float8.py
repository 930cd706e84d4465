"""The fp8 vocabulary (issue 29): recipes, names in every family, configs, refusals.

Execution: tests/backends/torch/test_torch_float8.py (torchao) and
tests/backends/keras/suite/test_float8.py (Keras's float8 layers, every backend).
"""

import json

import numpy as np
import pytest

from conftest import require_module

import mixedpolicy as mp
from mixedpolicy import Float8Recipe, Policy


@pytest.mark.parametrize("name, recipe, source", [
    ("float8_from_mixed_bfloat16", "delayed", "mixed_bfloat16"),
    ("float8_from_float32", "delayed", "float32"),
    ("float8_from_mixed_float16", "delayed", "mixed_float16"),
    ("p=f32,c=bf16,float8=tensorwise", "tensorwise", "mixed_bfloat16"),
    ("params=float32,compute=bfloat16,f8=rowwise", "rowwise", "mixed_bfloat16"),
    ("p=f32,c=bf16,float8=delayed,amax_history_len=16,margin=1", "delayed", "mixed_bfloat16"),
])
def test_every_spelling_names_a_recipe_over_a_source_and_round_trips(name, recipe, source):
    p = Policy(name)
    assert p.float8_recipe.recipe == recipe and p.source == Policy(source)
    assert Policy(p.name) == p and hash(Policy(p.name)) == hash(p)
    assert Policy.from_config(json.loads(json.dumps(p.get_config()))) == p
    assert p.needs_loss_scaling == Policy(source).needs_loss_scaling  # the loss scale follows the source


def test_keras_names_mean_keras_delayed_scaling_and_the_keywords_change_it():
    assert Policy("float8_from_mixed_bfloat16") == Policy("mixed_bfloat16", float8_recipe="delayed")
    assert Policy("float8_from_mixed_bfloat16").float8_recipe == Float8Recipe("delayed", amax_history_len=1024, margin=0)
    short = Policy("float8_from_mixed_bfloat16", amax_history_len=16)
    assert short.name == "params=float32,compute=bfloat16,output=bfloat16,float8=delayed,amax_history_len=16"
    assert Policy(short.name) == short
    assert Policy("mixed_bfloat16", float8_recipe="current") == Policy("p=f32,c=bf16,float8=tensorwise")
    e4m3 = Policy("mixed_bfloat16", float8_recipe=Float8Recipe("tensorwise", backward_dtype="e4m3"))
    assert Policy(e4m3.name) == e4m3 and "float8_backward=float8_e4m3fn" in e4m3.name
    assert Float8Recipe("rowwise").backward_dtype == "float8_e4m3fn"  # torchao's formats
    assert Policy(Policy("float8_from_float32")) == Policy("float8_from_float32")
    assert str(Policy("float8_from_float32").source) == "float32"


@pytest.mark.parametrize("kwargs, says", [
    (dict(name="mixed_bfloat16", float8_recipe="tensorwize"), r"'tensorwize'.*Expected one of \['tensorwise', 'delayed'"),
    (dict(name="float8_from_float64"), r"float8_from_float32.*jmp form"),
    (dict(name="float64", float8_recipe="delayed"), "float64 policy; fp8 matmuls take float32, bfloat16 or float16"),
    (dict(name="mixed_bfloat16", float8_recipe="tensorwise", margin=2), "only the 'delayed' recipe keeps an amax history"),
    (dict(name="mixed_bfloat16", float8_recipe="delayed", amax_history_len=0), "amax_history_len=0; expected an integer of at least 1"),
    (dict(name="mixed_bfloat16", amax_history_len=8), "without an fp8 recipe"),
    (dict(name=None, compute_dtype="e4m3"), "8-bit floats hold no variables.*float8_recipe="),
    (dict(name=None, variable_dtype="float8_e5m2"), "8-bit floats hold no variables"),
    (dict(name="e4m3"), "not a policy mixedpolicy knows.*float8_recipe="),
    (dict(name="p=f32,margin=1"), "no 'float8=<recipe>'"),
    (dict(name="mixed_bfloat16", float8_recipe=Float8Recipe("tensorwise"), margin=1), "only the 'delayed'"),
    (dict(name="p=f32,float8=rowwise,float8_backward=e5m2"), "whose anchor \\(torchao\\) runs float8_e4m3fn/float8_e4m3fn only"),
])
def test_bad_spellings_and_impossible_combinations_are_refused_with_the_fix(kwargs, says):
    with pytest.raises((ValueError, TypeError), match=says):
        Policy(**kwargs)


def test_a_bad_recipe_config_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match="expected the keys"):
        Float8Recipe.from_config({"recipe": "delayed", "history": 3})
    with pytest.raises(TypeError, match="float8_recipe=3"):
        Policy("mixed_bfloat16", float8_recipe=3)


def test_keras_round_trip_of_its_fp8_policies():
    keras = require_module("keras")
    k = Policy("float8_from_mixed_bfloat16", amax_history_len=16).to_keras()
    assert type(k).__name__ == "QuantizedFloat8DTypePolicy" and k.amax_history_length == 16
    assert Policy.from_keras(k) == Policy("float8_from_mixed_bfloat16", amax_history_len=16)
    assert Policy.from_keras(keras.dtype_policies.get("float8_from_float32")) == Policy("float8_from_float32")
    with pytest.raises(ValueError, match="Keras cannot express.*'delayed' recipe, margin 0"):
        Policy("mixed_bfloat16", float8_recipe="tensorwise").to_keras()
    with pytest.raises(ValueError, match="quantized Keras policy"):
        Policy.from_keras(keras.dtype_policies.get("int8_from_float32"))


def test_a_framework_without_an_fp8_path_refuses_fp8_before_anything_changes():
    with pytest.raises(ValueError, match="plain function .* runs the 'tensorwise' .* and 'delayed'.*'rowwise' runs on torch"):
        mp.apply_policy(lambda w, x: w @ x, mp.Policy("float8_from_float32", float8_recipe="rowwise"))
    f = mp.apply_policy(lambda w, x: w @ x, mp.Policy("float32", float8_recipe="tensorwise"))
    with pytest.raises(TypeError, match="Received numpy arrays .* plain function's matmuls run in fp8"):
        f(np.ones((16, 16), np.float32), np.ones((16, 16), np.float32))
    tf = require_module("tensorflow")
    module = tf.Module()
    with pytest.raises(ValueError, match="fp8 policy float8_from_float32 for Module.*nothing was applied"):
        mp.apply_policy(module, mp.PolicyMap("mixed_bfloat16", {"x": "float8_from_float32"}))


def test_the_auto_filter_keeps_matmuls_too_small_to_gain_and_a_key_still_wins():
    """Per tensor (measured on an H200), either size <= 1024 or both <= 2048 stay out; per row
    (torchao's H100 thresholds), out <= 2048, in <= 1024, or out <= 4096 with in <= 2048."""
    from mixedpolicy.float8 import too_small_to_gain
    from mixedpolicy.policy_map import LayerInfo

    assert too_small_to_gain("tensorwise", 3072, 768) and too_small_to_gain("tensorwise", 768, 3072)
    assert too_small_to_gain("tensorwise", 2048, 2048) and not too_small_to_gain("tensorwise", 2048, 2064)
    assert too_small_to_gain("delayed", 8192, 1024) and not too_small_to_gain("delayed", 1040, 4096)
    assert too_small_to_gain("rowwise", 4096, 2048) and too_small_to_gain("rowwise", 2048, 4096)
    assert not too_small_to_gain("rowwise", 2049, 4096) and not too_small_to_gain("rowwise_with_gw_hp", 8192, 8192)
    fp8 = Policy("p=f32,c=bf16,float8=tensorwise")
    auto = mp.PolicyMap(fp8, {"pinned": fp8}, float8_auto_filter=True)
    root = LayerInfo("", object)
    small, big = LayerInfo("down", object, matmul=(3072, 768)), LayerInfo("up", object, matmul=(3072, 4096))
    kept = auto.resolve([root, small])
    assert kept.policy == Policy("mixed_bfloat16") and kept.origin == "rule"
    assert "3072 -> 768" in kept.source and "float8_auto_filter" in kept.source
    assert auto.resolve([root, big]).policy == fp8
    assert auto.resolve([root, small._replace(path="pinned")]).policy == fp8  # a key wins
    assert mp.PolicyMap(fp8).resolve([root, small]).policy == fp8  # off by default, as torchao and Keras
    assert auto.with_default("mixed_bfloat16").float8_auto_filter
    with pytest.raises(TypeError, match="float8_auto_filter='yes'; expected True or False"):
        mp.PolicyMap(fp8, float8_auto_filter="yes")
    with pytest.raises(ValueError, match="recipe='rowwize'; expected one of tensorwise"):
        too_small_to_gain("rowwize", 64, 64)
    with pytest.raises(ValueError, match="in_features=0; expected a positive integer"):
        too_small_to_gain("tensorwise", 0, 64)
