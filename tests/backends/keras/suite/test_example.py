"""examples/keras_mlp.py trains unchanged under this Keras backend, mixed_float16 near float32.

Run by tests/backends/keras/test_keras.py once per Keras backend; not collected by the main run.
"""

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


def test_the_keras_example_trains_every_policy_near_float32():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import keras_mlp
    finally:
        sys.path.pop(0)
    base, _, _ = keras_mlp.train("float32", epochs=4)
    acc, skipped, scale = keras_mlp.train("mixed_float16", epochs=4)
    assert base > 0.85 and abs(acc - base) <= 0.05, (base, acc)
    assert 1.0 <= scale <= 2.0**24 and skipped >= 0


def test_this_process_runs_the_backend_it_was_given():
    import os

    import keras

    assert keras.backend.backend() == os.environ["KERAS_BACKEND"]
