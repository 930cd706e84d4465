"""TensorFlow: tensors, and policies on raw ``tf.Module`` models."""
