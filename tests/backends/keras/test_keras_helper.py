"""The helper that runs a test body under each Keras backend reports a failure with its backend
(that each process really runs the backend asked for: test_keras.py's global-policy test)."""

import pytest

from keras_helper import run_under_keras_backends


def test_failure_reports_the_backend_and_output():
    with pytest.raises(AssertionError, match="(?s)KERAS_BACKEND=jax.*boom"):
        run_under_keras_backends("raise SystemExit('boom')", backends=("jax",))
