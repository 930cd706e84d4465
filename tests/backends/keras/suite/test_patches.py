"""mixedpolicy's changes to Keras's modules are in one place and undo: after
``mp.keras.uninstall()`` Keras's ``dtype_policy()`` and the optimizer ``compile`` wraps a
float16 model with are Keras's own; setting a global policy installs the wrapper again.
Run by tests/backends/keras/test_keras.py once per Keras backend."""

import threading

import keras
from keras.src.dtype_policies import dtype_policy as keras_dtype_policy
from keras.src.trainers import trainer

import mixedpolicy as mp
from mixedpolicy.backends.keras import patches


def test_uninstall_gives_keras_its_own_functions_back_and_a_global_policy_reinstalls():
    assert mp.keras.installed()  # importing Keras with mixedpolicy loaded installs the wrapper
    mp.set_global_policy("mixed_float16")
    try:
        assert trainer.LossScaleOptimizer is not keras.optimizers.LossScaleOptimizer  # compile's name
        mp.keras.uninstall()
        assert not mp.keras.installed()
        assert keras_dtype_policy.dtype_policy is patches._keras_own
        assert trainer.LossScaleOptimizer is keras.optimizers.LossScaleOptimizer
        assert not hasattr(trainer.Trainer.compile, "mixedpolicy_patch")  # Keras's own compile
        # plain Keras again: a thread that set no policy builds with Keras's default
        seen = []
        worker = threading.Thread(target=lambda: seen.append(keras.layers.Dense(2).dtype_policy.name))
        worker.start()
        worker.join()
        assert seen == ["float32"]
        # this thread keeps the Keras policy set through Keras's own setter
        assert keras.layers.Dense(2).dtype_policy.name == "mixed_float16"
        mp.set_global_policy("mixed_bfloat16")  # installs again
        assert mp.keras.installed()
        seen.clear()
        worker = threading.Thread(target=lambda: seen.append(keras.layers.Dense(2).dtype_policy.name))
        worker.start()
        worker.join()
        assert seen == ["mixed_bfloat16"]
    finally:
        mp.set_global_policy(None)
        keras.config.set_dtype_policy("float32")
