"""The helper that runs a test body under each Keras backend really switches backends."""

from conftest import require_module
from keras_helper import KERAS_BACKENDS, run_under_keras_backends


def test_each_backend_runs_in_its_own_process():
    require_module("keras")
    out = run_under_keras_backends("""
        import keras, os
        print(keras.backend.backend(), os.getpid())
    """)
    assert [out[b].split()[0] for b in KERAS_BACKENDS] == list(KERAS_BACKENDS)
    assert len({out[b].split()[1] for b in KERAS_BACKENDS}) == 3


def test_failure_reports_the_backend_and_output():
    import pytest

    with pytest.raises(AssertionError, match="(?s)KERAS_BACKEND=jax.*boom"):
        run_under_keras_backends("raise SystemExit('boom')", backends=("jax",))
