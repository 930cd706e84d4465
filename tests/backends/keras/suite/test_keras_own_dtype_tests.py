"""Keras's own dtype-policy, layer mixed-precision and trainer tests, with mixedpolicy in play.

Each Keras test runs unchanged in a process where mixedpolicy is imported (its import hook
and its patched global-policy getter are active), and the global-policy tests run again
with Keras's `set_dtype_policy` replaced by `mp.set_global_policy`. Deliberate
differences, each asserted below: mixedpolicy has no quantized policies
("int8_from_mixed_bfloat16" is a ValueError naming the policy and the Keras recipe), and a value of the wrong
type (12345) is a TypeError, Python's convention, where Keras raises ValueError.

Run by tests/backends/keras/test_keras.py once per Keras backend, in a pytest process of its own.
"""

import sys
import unittest

import keras
import pytest

import mixedpolicy as mp


def _run(case: type, names: list[str] | None = None, at_least: int = 1) -> unittest.TestResult:
    loader = unittest.TestLoader()
    suite = (loader.loadTestsFromTestCase(case) if names is None
             else unittest.TestSuite(case(n) for n in names))
    result = unittest.TextTestRunner(stream=sys.stdout, verbosity=0).run(suite)
    assert result.testsRun >= at_least, (case, result.testsRun)
    return result


def _ok(result: unittest.TestResult) -> None:
    assert result.wasSuccessful(), (result.failures, result.errors)


@pytest.fixture(autouse=True)
def _as_keras_runs_them():
    """Keras's CI runs JAX with standard promotion (this suite's conftest makes it strict);
    the global policy is float32 again afterwards."""
    import contextlib

    promotion = contextlib.nullcontext()
    if keras.backend.backend() == "jax":
        import jax

        promotion = jax.numpy_dtype_promotion("standard")
    with promotion:
        yield
    mp.set_global_policy(None)


def test_keras_dtype_policy_tests_unchanged():
    import keras.src.dtype_policies.dtype_policy_test as t

    cases = [getattr(t, n) for n in dir(t) if n.endswith("Test") and isinstance(getattr(t, n), type)]
    assert len(cases) >= 6
    for case in cases:
        _ok(_run(case))


def test_keras_global_policy_tests_through_set_global_policy(monkeypatch):
    import keras.src.dtype_policies.dtype_policy_test as t

    monkeypatch.setattr(t, "set_dtype_policy", mp.set_global_policy)
    quantized = ["test_set_dtype_policy_valid_string_quantized",
                 "test_set_dtype_policy_valid_policy_quantized"]
    case = t.DTypePolicyGlobalFunctionsTest
    names = [n for n in unittest.TestLoader().getTestCaseNames(case)
             if n not in quantized and n != "test_set_dtype_policy_invalid"]
    _ok(_run(case, names, at_least=7))
    # the deliberate differences
    result = _run(case, quantized, at_least=2)
    assert not result.failures and len(result.errors) == 2 and all("integer weights" in e[1]
                                           for e in result.errors), result.errors
    with pytest.raises(TypeError, match="Received policy=12345 of type int"):
        mp.set_global_policy(12345)


def test_keras_layer_mixed_precision_tests_unchanged():
    import keras.src.layers.layer_test as t

    names = ["test_mixed_precision", "test_autocast_with_np_array", "test_dtype_policy_setter",
             "test_serialize_dtype", "test_keras_mask_with_autocast"]
    if keras.backend.backend() != "torch":  # Keras skips it there too: float16 CPU kernels
        names.append("test_autocast")
    _ok(_run(t.LayerTest, names, at_least=len(names)))
    # and once more with a mixed global policy set through mixedpolicy and taken back
    mp.set_global_policy("mixed_bfloat16")
    mp.set_global_policy(None)
    _ok(_run(t.LayerTest, names, at_least=len(names)))


def test_keras_trainer_mixed_precision_tests_unchanged():
    import keras.src.trainers.trainer_test as t

    names = ["test_adds_loss_scaling_optimizer"]
    if keras.backend.backend() != "torch":  # Keras skips it there too: float16 CPU kernels
        names.append("test_loss_scaling_prevents_underflow")
    _ok(_run(t.TestTrainer, names, at_least=len(names)))
