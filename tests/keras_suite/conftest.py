"""This folder runs once per Keras backend (tests/test_keras.py starts it), never in the main run."""

import os

if not os.environ.get("MIXEDPOLICY_KERAS_SUITE"):
    collect_ignore_glob = ["*.py"]
