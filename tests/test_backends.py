"""The adapter interface, the registry, and the array operations on every backend."""

import numpy as np
import pytest

from mixedpolicy import backends
from mixedpolicy.backends.base import Adapter


def test_an_adapter_missing_a_method_fails_when_created():
    class Half(Adapter):
        name = "half"
        module = "half"

        def is_array(self, x):
            return False

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_unknown_backend_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"'tpu'; expected one of \[.*'numpy'.*\]"):
        backends.get_adapter("tpu")


def test_registry_never_imports_a_framework_to_check(monkeypatch):
    # An adapter whose framework is not imported is never loaded: loading this one
    # would fail, so classifying an object proves it was passed over.
    entry = backends._Entry("ghost", "not_an_imported_framework", "no_such_module:Ghost")
    monkeypatch.setattr(backends, "_ENTRIES", [entry] + backends._ENTRIES)
    monkeypatch.setattr(backends, "_by_type", {})
    assert backends.adapter_for_array(np.ones(2)).name == "numpy"
    assert backends.adapter_for(object(), "model") is None
    assert "ghost" not in backends._loaded


def test_classification_is_cached_per_type(monkeypatch):
    monkeypatch.setattr(backends, "_by_type", {})
    backends.adapter_for_array(np.ones(2))
    assert np.ndarray in backends._by_type


def test_python_numbers_are_held_by_numpy():
    assert backends.adapter_for_array(3.0).name == "numpy"
    assert backends.adapter_for_tree({"a": [1.0, None]}).name == "numpy"


def test_cast_tree_leaves_integers_and_structure(backend):
    tree = {"w": backend.asarray([1.5, 2.5], "float32"), "n": backend.asarray([1, 2], "int32"),
            "mask": backend.asarray([True, False], "bool"), "none": None}
    out = backends.cast_tree(tree, "bf16")
    assert backend.floating_dtype(out["w"]) == "bfloat16"
    assert backend.floating_dtype(out["n"]) is None and backend.floating_dtype(out["mask"]) is None
    assert np.asarray(out["n"]).dtype == np.int32 and np.asarray(out["mask"]).dtype == np.bool_
    assert out["none"] is None
    if backend.owns_arrays:
        assert backends.adapter_for_tree(tree).name == backend.name


def test_array_ops_on_every_backend(backend):
    x = backend.asarray([1.0, 2.0], "float32")
    assert backend.is_array(x) is backend.owns_arrays and not backend.is_array([1.0, 2.0])
    assert backend.floating_dtype(x) == "float32"
    assert backend.floating_dtype(backend.cast(x, "float16")) == "float16"
    if backend.name == "jax" and not __import__("jax").config.jax_enable_x64:
        with pytest.raises(ValueError, match="jax_enable_x64"):
            backend.cast(x, "float64")
    else:
        assert backend.floating_dtype(backend.cast(x, "float64")) == "float64"
    cond = backend.asarray([True, False], "bool")
    picked = backend.where(cond, x, backend.full_like(x, 7.0))
    assert np.asarray(picked).tolist() == [1.0, 7.0]
    assert np.asarray(backend.zeros_like(x)).tolist() == [0.0, 0.0]
    assert [np.asarray(leaf).tolist() for leaf in backend.leaves({"a": x, "b": [x]})] == [[1.0, 2.0]] * 2


def test_numpy_owns_no_model_or_optimizer():
    adapter = backends.get_adapter("numpy")
    assert adapter.role_of(np.ones(2)) is None
    for call in (lambda: adapter.apply_policy(None, None), lambda: adapter.describe(None),
                 lambda: adapter.remove_policy(None),
                 lambda: adapter.wrap_optimizer(None, None)):
        with pytest.raises(TypeError, match="numpy has no"):
            call()
