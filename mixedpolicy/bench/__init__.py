"""The framework-comparison harness behind `mixedpolicy bench` (see `mixedpolicy.bench.cli`)."""
