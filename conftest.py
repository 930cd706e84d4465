"""pytest at the repository root (tests/conftest.py has the suite's own settings).

``--doctest-modules`` imports every module of the package to look for examples; most have none,
and importing them (mixedpolicy.lightning imports Lightning, the bench's runners their
frameworks) cost every pytest worker seconds at collection. Only the modules whose source holds
an example are collected; the rest are imported by the tests that use them (and type-checked).
"""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent / "mixedpolicy"


def pytest_ignore_collect(collection_path, config):  # noqa: ARG001 (pytest's hook signature)
    path = Path(collection_path)
    if path.suffix != ".py" or _PACKAGE not in path.resolve().parents:
        return None
    try:
        return True if ">>>" not in path.read_text(encoding="utf-8") else None
    except OSError:
        return None
