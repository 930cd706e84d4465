"""Policy: every name family, normalisation, value semantics, serialisation, bad input."""

import dataclasses
import json
import re

import numpy as np
import pytest

from mixedpolicy import Policy, PolicyMap
from mixedpolicy.policy import as_policy

# name -> (variable, compute, output)
CASES = {
    "float32": ("float32", "float32", "float32"),
    "float16": ("float16", "float16", "float16"),
    "bfloat16": ("bfloat16", "bfloat16", "bfloat16"),
    "float64": ("float64", "float64", "float64"),
    "mixed_float16": ("float32", "float16", "float16"),
    "mixed_bfloat16": ("float32", "bfloat16", "bfloat16"),
    # jmp grammar, long and short, with jmp's defaults for what is left out
    "params=float32,compute=bfloat16,output=float32": ("float32", "bfloat16", "float32"),
    "p=f32,c=bf16,o=f32": ("float32", "bfloat16", "float32"),
    "c=f16": ("float32", "float16", "float16"),
    "p=f16,c=f16": ("float16", "float16", "float16"),
    "p=bf16": ("bfloat16", "bfloat16", "bfloat16"),
    "params=full,compute=half": ("float32", "float16", "float16"),
    "half": ("float16", "float16", "float16"),
    "full": ("float32", "float32", "float32"),
    # Lightning precision strings
    "16-mixed": ("float32", "float16", "float16"),
    "bf16-mixed": ("float32", "bfloat16", "bfloat16"),
    "32-true": ("float32", "float32", "float32"),
    "16-true": ("float16", "float16", "float16"),
    "bf16-true": ("bfloat16", "bfloat16", "bfloat16"),
    "64-true": ("float64", "float64", "float64"),
    # Lightning's legacy aliases that mean one thing everywhere
    "32": ("float32", "float32", "float32"),
    "64": ("float64", "float64", "float64"),
}


@pytest.mark.parametrize("name", CASES)
def test_every_name_family_normalises(name):
    p = Policy(name)
    assert (p.variable_dtype, p.compute_dtype, p.output_dtype) == CASES[name]
    # the canonical name parses back to the same value
    assert Policy(p.name) == p
    assert all(isinstance(d, str) for d in (p.name, p.compute_dtype, p.variable_dtype, p.output_dtype))


def test_equal_policies_hash_equal_across_families():
    family = {Policy("mixed_float16"), Policy("16-mixed"), Policy("c=f16"), Policy("p=f32,c=f16,o=f16"),
              Policy(None, compute_dtype="float16")}
    assert len(family) == 1
    assert Policy("16-mixed").name == "mixed_float16"


def test_canonical_names():
    assert Policy("bf16-true").name == "bfloat16"
    assert Policy("p=f32,c=bf16,o=f32").name == "params=float32,compute=bfloat16,output=float32"
    assert repr(Policy("mixed_bfloat16")) == "Policy('mixed_bfloat16')"
    assert str(Policy("half")) == "float16"


def test_needs_loss_scaling():
    assert Policy("mixed_float16").needs_loss_scaling
    assert Policy("float16").needs_loss_scaling
    assert not Policy("mixed_bfloat16").needs_loss_scaling
    assert not Policy("float32").needs_loss_scaling
    assert not Policy("p=f16,c=f32").needs_loss_scaling


def test_keywords_override_the_name_and_default_like_jmp():
    p = Policy("mixed_float16", output_dtype="float32")
    assert (p.variable_dtype, p.compute_dtype, p.output_dtype) == ("float32", "float16", "float32")
    assert Policy(None, variable_dtype="bf16") == Policy("bfloat16")
    assert Policy(None) == Policy("float32") == Policy()


def test_no_name_and_no_keywords_is_the_policy_in_force_as_kerass_dtype_policy_none():
    import mixedpolicy as mp

    for name in ("float32", "float16", "bfloat16", "mixed_float16", "mixed_bfloat16"):
        mp.set_global_policy(name)
        try:
            assert Policy() == Policy(None) == Policy(name=None) == Policy(name)
            assert Policy(name=None).name == name
            # keywords build from themselves alone, whatever the global policy (jmp's defaults)
            assert Policy(None, variable_dtype="bf16") == Policy("bfloat16")
        finally:
            mp.set_global_policy(None)
    with mp.policy_scope("mixed_bfloat16"):
        assert Policy() == Policy("mixed_bfloat16")
    assert Policy() == Policy("float32")


def test_dtype_objects_are_accepted():
    import ml_dtypes

    assert Policy(None, compute_dtype=np.float16).compute_dtype == "float16"
    assert Policy(None, compute_dtype=np.dtype("float16")).compute_dtype == "float16"
    assert Policy(None, compute_dtype=ml_dtypes.bfloat16).compute_dtype == "bfloat16"


def test_frozen_and_replace():
    p = Policy("mixed_float16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute_dtype = "bfloat16"
    q = dataclasses.replace(p, compute_dtype="bfloat16")
    assert q.name == "params=float32,compute=bfloat16,output=float16"
    assert p == Policy("mixed_float16")  # the original is unchanged
    assert dataclasses.replace(p, output_dtype="float16") == p


@pytest.mark.parametrize("name", CASES)
def test_config_and_json_round_trip(name):
    p = Policy(name)
    config = p.get_config()
    assert set(config) == {f.name for f in dataclasses.fields(Policy)}  # no field silently lost
    assert Policy.from_config(json.loads(json.dumps(config))) == p
    assert Policy.from_config({"name": p.name}) == p  # Keras's {"name": ...} form


def test_from_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"unknown keys \['dtype'\].*expected only"):
        Policy.from_config({"name": "float32", "dtype": "float16"})
    # layer keys where a policy goes: the message says where they go
    with pytest.raises(ValueError, match=r"unknown keys \['encoder.\*'\].*give them as overrides"):
        PolicyMap({"encoder.*": "float32"})
    with pytest.raises(TypeError, match="expected the dict returned by Policy.get_config"):
        Policy.from_config("float32")


@pytest.mark.parametrize("bad, exc, message", [
    ("mixed_float32", ValueError, "mixed policy computes in half precision"),
    ("mixed_int8", ValueError, "not a floating dtype"),
    ("int8", ValueError, "not a policy mixedpolicy knows.*Expected a Keras name"),
    ("banana", ValueError, "'banana'.*jmp policy.*Lightning"),
    ("p=f32,x=bf16", ValueError, "'x=bf16'.*'params' \\('p'\\)"),
    ("p=f32,p=bf16", ValueError, "sets 'params' twice"),
    ("p=f32,c=int8", ValueError, "not a floating dtype"),
    (16, TypeError, "'16-mixed'.*'float16'"),
    ("16", ValueError, "ambiguous.*'16-mixed'.*'float16'"),
    # Lightning reads "bf16" as bf16-mixed, jmp as bfloat16 everywhere: both readings named
    ("bf16", ValueError, "ambiguous: Lightning.*'bf16-mixed'.*jmp.*'bfloat16'"),
    (" BF16 ", ValueError, "ambiguous"),
    (3.5, TypeError, "of type float"),
])
def test_bad_names_say_what_how_and_what_is_valid(bad, exc, message):
    with pytest.raises(exc, match=message):
        Policy(bad)


def test_suggested_aliases_are_accepted():
    # Every name an error message suggests must itself work.
    from mixedpolicy._names import _valid_names_hint

    suggested = re.findall(r"'([^']+)'", _valid_names_hint())
    assert len(suggested) >= 12
    for name in suggested:
        Policy(name)
    for dtype in ("f16", "bf16", "f32", "half", "full", "float16", "bfloat16", "float32", "float64"):
        Policy(None, compute_dtype=dtype)
    for name in ("mixed_float16", "mixed_bfloat16", "16-mixed", "float16"):  # from the int-name hint
        Policy(name)


def test_lightning_numbers_32_and_64_mean_what_lightning_means():
    assert Policy(32) == Policy("32") == Policy("32-true") == Policy("float32")
    assert Policy(64) == Policy("64-true") == Policy("float64")
    assert Policy(32).name == "float32"
    with pytest.raises(TypeError, match="bool"):
        Policy(True)


def test_lightnings_transformer_engine_strings_are_fp8_over_their_weights_dtype():
    """Lightning's precision="transformer-engine": weights in bfloat16, matmuls in fp8 under TE's
    default DelayedScaling (margin 0, a history of 1024, e4m3 / e5m2): Keras's float8_from_bfloat16."""
    te = Policy("transformer-engine")
    assert te == Policy("float8_from_bfloat16") and te.name == "float8_from_bfloat16"
    assert (te.variable_dtype, te.compute_dtype) == ("bfloat16", "bfloat16")
    recipe = te.float8_recipe
    assert (recipe.recipe, recipe.amax_history_len, recipe.margin) == ("delayed", 1024, 0)
    assert (recipe.forward_dtype, recipe.backward_dtype) == ("float8_e4m3fn", "float8_e5m2")
    assert Policy("transformer-engine-float16") == Policy("float8_from_float16")
    with pytest.raises(ValueError, match="'transformer-engine', 'transformer-engine-float16'"):
        Policy("transformer-engine-bf16")  # the hint lists Lightning's strings, these two included


def test_bad_dtype_keyword():
    with pytest.raises(ValueError, match="compute_dtype='int32'"):
        Policy(None, compute_dtype="int32")
    with pytest.raises(TypeError, match="variable_dtype=True"):
        Policy(None, variable_dtype=True)


def test_as_policy_accepts_duck_typed_keras_and_jmp_policies():
    class KerasLike:
        variable_dtype = "float32"
        compute_dtype = "bfloat16"

    class JmpLike:
        param_dtype = np.dtype("float32")
        compute_dtype = np.dtype("float16")
        output_dtype = np.dtype("float32")

    assert as_policy(KerasLike()) == Policy("mixed_bfloat16")
    assert as_policy(JmpLike()) == Policy("p=f32,c=f16,o=f32")
    assert as_policy({"name": "bf16-mixed"}) == Policy("mixed_bfloat16")
    with pytest.raises(TypeError, match="expected a Policy, a policy name"):
        as_policy(1.5)


def test_keras_conversion_round_trip():
    from conftest import require_module

    keras = require_module("keras")
    for name in ("float32", "mixed_float16", "mixed_bfloat16", "bfloat16"):
        dtype_policy = Policy(name).to_keras()
        assert isinstance(dtype_policy, keras.DTypePolicy)
        assert dtype_policy.name == name
        assert Policy.from_keras(dtype_policy) == Policy(name)
    with pytest.raises(ValueError, match="Keras cannot express"):
        Policy("p=f32,c=bf16,o=f32").to_keras()


def test_jmp_conversion_round_trip():
    from conftest import require_module

    require_module("jax")
    jmp = require_module("jmp", "jax")
    for name in CASES:
        p = Policy(name)
        j = p.to_jmp()
        assert isinstance(j, jmp.Policy)
        assert Policy.from_jmp(j) == p
    assert Policy.from_jmp(jmp.get_policy("p=f32,c=bf16,o=f32")) == Policy("p=f32,c=bf16,o=f32")


def test_a_dtype_object_names_the_policy_of_that_dtype_and_jmp_spellings_work():
    """jmp's Policy(dtype, dtype, dtype) and its param_dtype / with_output_dtype."""
    assert Policy(np.float16) == Policy(np.dtype("float16")) == Policy("float16")
    assert as_policy(np.float32) == Policy("float32")
    with pytest.raises(ValueError, match=r"name=<class 'numpy.int8'>.*not a floating dtype"):
        Policy(np.int8)
    p = Policy("mixed_bfloat16")
    assert p.param_dtype == p.variable_dtype == "float32"
    q = p.with_output_dtype(np.float32)
    assert q == Policy("p=f32,c=bf16,o=f32") and p.output_dtype == "bfloat16"
    with pytest.raises(ValueError, match="output_dtype='int32'"):
        p.with_output_dtype("int32")


def test_jmps_three_positional_dtypes_and_dtypes_that_equal_dtype_objects():
    """jmp's Policy(param, compute, output), and its habit of comparing a policy's dtypes with
    dtype objects (`policy.compute_dtype == jnp.float16`), which plain strings answer False."""
    import json
    import pickle

    import ml_dtypes

    p = Policy(np.float32, ml_dtypes.bfloat16, np.float32)
    assert p == Policy("p=f32,c=bf16,o=f32") == Policy("float32", "bfloat16", "float32")
    assert p.param_dtype == np.float32 and p.compute_dtype == ml_dtypes.bfloat16 == np.dtype(ml_dtypes.bfloat16)
    assert p.compute_dtype == "bfloat16" and p.compute_dtype != "bf16" and p.compute_dtype != np.float16
    assert p.output_dtype != np.int32 and p.output_dtype != 32 and p.compute_dtype != None  # noqa: E711
    assert {"bfloat16": 1}[p.compute_dtype] == 1 and type(str(p.compute_dtype)) is str
    assert pickle.loads(pickle.dumps(p)) == p and json.loads(json.dumps(p.get_config()))["compute_dtype"] == "bfloat16"
    assert pickle.loads(pickle.dumps(p)).compute_dtype == ml_dtypes.bfloat16
    assert all(type(v) is str for k, v in p.get_config().items() if k != "float8_recipe")
    yaml = pytest.importorskip("yaml")  # (its safe dumper refuses str subclasses unless told)
    assert yaml.safe_dump({"dtype": p.compute_dtype}) == yaml.dump({"dtype": p.compute_dtype}) == "dtype: bfloat16\n"
    assert Policy(np.float16, np.float16, np.float16) == Policy("float16")
    assert Policy("mixed_bfloat16", reduce_dtype="e5m2").reduce_dtype == ml_dtypes.float8_e5m2 != ml_dtypes.float8_e4m3fn


def test_a_framework_dtype_names_the_policy_and_a_tensor_does_not():
    from conftest import require_module

    torch = require_module("torch")
    assert Policy(torch.bfloat16) == Policy("bfloat16") and as_policy(torch.float16) == Policy("float16")
    assert Policy("mixed_float16").compute_dtype == torch.float16 and torch.float32 == Policy("mixed_float16").variable_dtype
    assert Policy("mixed_float16").compute_dtype != torch.bfloat16
    with pytest.raises(TypeError, match="of type Tensor; expected a string such as 'mixed_float16', a floating dtype"):
        Policy(torch.ones(2))


def test_unknown_names_say_so_in_jmps_words():
    """jmp's tests match "Unknown dtype" (and "Unknown key") in its refusals; ours say it too,
    with what was received and what is valid."""
    for name in ("compute_float16", "c=f17"):
        with pytest.raises(ValueError, match="Unknown dtype") as err:
            Policy(name)
        assert name.partition("=")[2] in str(err.value) and "Expected" in str(err.value)
    with pytest.raises(ValueError, match="Unknown key in the part 'x=f16'"):
        Policy("x=f16")


def test_quantization_mode_reads_as_kerass():
    assert Policy("mixed_float16").quantization_mode is None
    assert Policy("float8_from_mixed_bfloat16").quantization_mode == "float8"
    assert Policy("mixed_bfloat16", float8_recipe="tensorwise").quantization_mode == "float8"
