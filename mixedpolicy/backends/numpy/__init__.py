"""numpy: array operations only."""
