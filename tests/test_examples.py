"""Every script in examples/ runs (the README's and the guides' code blocks: test_docs.py)."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# keras_mlp.py runs under every Keras backend in tests/backends/keras/suite/test_example.py
SMOKE = [p for p in EXAMPLES if p.name != "keras_mlp.py"]


def test_there_are_examples():
    assert EXAMPLES


@pytest.mark.slow
@pytest.mark.parametrize("script", SMOKE, ids=lambda p: p.name)
def test_example_runs(script):
    # two epochs per policy: the script runs as a user runs it, end to end (how well each policy
    # trains is checked on the examples' train functions, below and in the Keras suite)
    proc = subprocess.run([sys.executable, str(script), "--epochs", "2"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "accuracy" in proc.stdout


def test_numpy_example_matches_float32_and_shows_skipped_steps():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import numpy as np
        import numpy_loss_scaling as ex
    finally:
        sys.path.pop(0)
    with np.errstate(over="ignore", invalid="ignore"):
        acc32, skipped32, _, _ = ex.train("float32", epochs=10)
        acc16, skipped16, scale16, wdtype = ex.train("mixed_float16", epochs=10)
    assert skipped32 == 0 and skipped16 > 0  # the too-high initial scale is backed off
    assert scale16 < 2.0**24 and wdtype == np.float32
    assert abs(acc32 - acc16) <= 0.02


def test_guide_policy_table_is_true():
    import mixedpolicy as mp

    text = (ROOT / "docs" / "guide.md").read_text()
    rows = re.findall(r"^\| (`.*?) \| `(.*?)` \|", text, re.M)
    assert len(rows) >= 6
    for spellings, canonical in rows:
        for name in re.findall(r'"([^"]+)"', spellings):
            assert mp.Policy(name).name == canonical, name


@pytest.mark.slow
def test_jax_example_trains_every_policy_near_float32():
    from conftest import require_module

    require_module("flax", "jax")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import jax_mlp
    finally:
        sys.path.pop(0)
    base, _, _ = jax_mlp.train("float32", epochs=4)
    acc, skipped, scale = jax_mlp.train("mixed_float16", epochs=4)
    assert base > 0.9 and abs(acc - base) <= 0.03
    assert skipped >= 0 and 1.0 <= scale <= 2.0**24


def test_without_scikit_learn_an_example_names_the_extra_to_install():
    blocker = ("import sys, runpy; sys.modules['sklearn'] = None; "
               f"runpy.run_path({str(ROOT / 'examples' / 'numpy_loss_scaling.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1 and "pip install 'mixedpolicy[bench]'" in proc.stderr, proc.stderr[-2000:]
