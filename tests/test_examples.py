"""Every script in examples/ runs, and the README's quick start runs as written."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_there_are_examples():
    assert EXAMPLES


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script):
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
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


def test_readme_quick_start_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_guide_policy_table_is_true():
    import mixedpolicy as mp

    text = (ROOT / "docs" / "guide.md").read_text()
    rows = re.findall(r"^\| (`.*?) \| `(.*?)` \|", text, re.M)
    assert len(rows) >= 6
    for spellings, canonical in rows:
        for name in re.findall(r'"([^"]+)"', spellings):
            assert mp.Policy(name).name == canonical, name


@pytest.mark.parametrize("script, frameworks", [
    ("torch_overhead.py", ["torch"]), ("jax_overhead.py", ["jax"]),
    ("keras_overhead.py", ["keras-jax", "keras-torch", "keras-tensorflow"])])
def test_overhead_benchmark_is_the_bench_on_its_frameworks(tmp_path, script, frameworks):
    import json

    from conftest import require_module

    require_module(script.split("_")[0])
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--policies", "mixed_float16",
                           "--steps", "2", "--repeats", "2", "--warmup", "1", "--min-block-time", "0",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["framework"] for r in runs] == frameworks
    assert all(r["policy"] == "mixed_float16" and r["overhead_vs_native"] > 0 for r in runs)
    assert "overhead vs native" in proc.stdout


def test_overhead_benchmark_refuses_other_frameworks(capsys):
    from mixedpolicy.bench.cli import overhead

    with pytest.raises(SystemExit) as stop:
        overhead(["torch"], ["--frameworks", "jax"])
    assert stop.value.code == 2
    assert "runs --frameworks torch; received --frameworks jax" in capsys.readouterr().err


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


def test_keras_example_runs_unchanged_under_every_backend():
    from conftest import require_module
    from keras_helper import KERAS_BACKENDS, run_under_keras_backends

    require_module("keras")
    out = run_under_keras_backends(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "examples")!r})
        import keras_mlp
        base, _, _ = keras_mlp.train("float32", epochs=4)
        acc, skipped, scale = keras_mlp.train("mixed_float16", epochs=4)
        assert base > 0.85 and abs(acc - base) <= 0.05, (base, acc)
        assert 1.0 <= scale <= 2.0**24
        print("ok", skipped)
    """)
    assert all(out[b].startswith("ok") for b in KERAS_BACKENDS), out
