"""TensorFlow: reducing gradients across ``tf.distribute`` replicas in a policy's reduce dtype.

Importing this module imports TensorFlow. Keras models on TensorFlow need no call: the
`LossScaleOptimizer` reduces in the policy's reduce dtype under a strategy.
"""

from mixedpolicy.backends.tensorflow.reduce import CARRIED, all_reduce, bytes_per_step

__all__ = ["CARRIED", "all_reduce", "bytes_per_step"]
