"""The helper that runs a test body under each Keras backend really switches backends."""

import pytest

from conftest import require_module
from keras_helper import KERAS_BACKENDS, run_under_keras_backends


@pytest.mark.slow
def test_each_backend_runs_in_its_own_process():
    require_module("keras")
    two = KERAS_BACKENDS[:2]  # two are enough to see it switch (all three run tests/backends/keras/suite)
    out = run_under_keras_backends("""
        import keras, os
        print(keras.backend.backend(), os.getpid())
    """, backends=two)
    assert [out[b].split()[0] for b in two] == list(two)
    assert len({out[b].split()[1] for b in two}) == 2


def test_failure_reports_the_backend_and_output():
    import pytest

    with pytest.raises(AssertionError, match="(?s)KERAS_BACKEND=jax.*boom"):
        run_under_keras_backends("raise SystemExit('boom')", backends=("jax",))
