"""`mixedpolicy bench`: option checks before any run, and a run's record and outputs."""

import json
import subprocess
import sys

import pytest

from mixedpolicy.__main__ import main as cli
from mixedpolicy.bench import spec
from mixedpolicy.bench.cli import main as bench
from mixedpolicy.bench.data import batch_order, init_weights

FIELDS = {"framework", "policy", "model", "batch_size", "steps", "step_time_s", "throughput_samples_per_s",
          "peak_memory_bytes", "final_loss", "accuracy", "skipped_steps", "final_loss_scale",
          "overhead_vs_native"}


@pytest.mark.parametrize("args, message", [
    (["--frameworks", "mxnet"], r"--frameworks 'mxnet', which is not valid; expected any of: torch, jax"),
    (["--policies", "mixed_float8"], r"'mixed_float8'.*expected any of: float32, mixed_bfloat16"),
    (["--model", "gpt"], r"--model 'gpt'; expected one of: mlp"),
    (["--steps", "0"], r"--steps 0; expected a whole number >= 1"),
    (["--device", "tpu"], r"--device 'tpu'"),
])
def test_bad_options_stop_before_any_run(args, message, capsys, tmp_path):
    assert bench(args + ["--out", str(tmp_path / "out")]) == 2
    assert __import__("re").search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written


def test_a_framework_not_installed_names_the_installed_ones(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(spec, "missing_packages", lambda f: ["torch"] if "torch" in f else [])
    assert bench(["--frameworks", "keras-torch", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "keras-torch, but torch is not installed" in err and "jax, tensorflow, keras-jax" in err


def test_unknown_command_and_help(capsys):
    assert cli(["benchmark"]) == 2 and "expected one of: bench" in capsys.readouterr().err
    assert cli(["--help"]) == 0


def test_shared_weights_and_batch_order_are_deterministic():
    a, b = init_weights(0), init_weights(0)
    assert all((x == y).all() for x, y in zip(a, b)) and [w.shape for w in a][:2] == [(64, 128), (128,)]
    order = batch_order(100, 32, 7, seed=0)
    assert order.shape == (7, 32) and (order == batch_order(100, 32, 7, seed=0)).all()
    assert len(set(order[:3].ravel())) == 96  # an epoch has no repeats
    with pytest.raises(ValueError, match="--batch-size 200"):
        batch_order(100, 200, 1)


def test_a_small_run_writes_every_output_with_every_field(tmp_path):
    from conftest import require_module

    require_module("torch")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mixedpolicy", "bench", "--frameworks", "torch",
                           "--policies", "float32,mixed_float16", "--steps", "2", "--repeats", "2",
                           "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[2/2] torch mixed_float16" in proc.stdout and "overhead vs native" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert {"versions", "device", "tf32", "date"} <= set(results["environment"])
    assert [(r["framework"], r["policy"]) for r in results["runs"]] == [("torch", "float32"),
                                                                        ("torch", "mixed_float16")]
    for run in results["runs"]:
        assert FIELDS <= set(run), FIELDS - set(run)
        assert set(run["step_time_s"]) == {"median", "min", "max"}
        assert 0 <= run["accuracy"] <= 1 and run["overhead_vs_native"] > 0
    assert results["runs"][1]["final_loss_scale"] is not None
    assert "| torch | mixed_float16 |" in (out / "report.md").read_text()
    for png in ("step_time.png", "loss_curves.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
