"""Keras 3 on any backend: per-layer dtype policies, the global policy, the loss-scale optimizer."""
