"""`mixedpolicy bench`: option checks before any run, and a run's record and outputs."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mixedpolicy.__main__ import main as cli
from mixedpolicy.bench import models, spec
from mixedpolicy.bench.runners import environment as _worker_env
from mixedpolicy.bench.cli import main as bench
from mixedpolicy.bench import data
from mixedpolicy.bench.data import batch_order

import zoo_helper

FIELDS = {"framework", "policy", "model", "batch_size", "steps", "step_time_s", "throughput_samples_per_s",
          "peak_memory_bytes", "final_loss", "accuracy", "skipped_steps", "final_loss_scale",
          "overhead_vs_native", "overhead_ci", "speedup_vs_float32", "speedup_ratios", "speedup_ci", "memory",
          "max_loss_gap_vs_native", "accuracy_gap_vs_float32", "test_loss"}


@pytest.mark.parametrize("args, message", [
    (["--frameworks", "mxnet"], r"--frameworks 'mxnet', which is not valid; expected any of: torch, jax"),
    (["--policies", "mixed_float8"], r"'mixed_float8', which names no policy: .*The bench runs float32, mixed_bfloat16"),
    (["--policies", "p=f32,c=f99"], r"'p=f32,c=f99', which names no policy: Received compute .*'f99'"),
    (["--model", "gpt"], r"--model 'gpt'; expected one of: mlp, cnn, transformer, resnet, resnet50, gpt2"),
    (["--steps", "0"], r"--steps 0; expected a whole number >= 1"),
    (["--device", "tpu"], r"--device 'tpu'"),
    (["--device", "cuda"], r"--device cuda, but this machine has no NVIDIA GPU"),
    (["--batch-size", "100000"], r"--batch-size 100000 on 1 replica\(s\), more than the 1347 training samples"),
    (["--replicas", "-2"], r"--replicas -2; expected a whole number from 2 to 64"),
    (["--replicas", "1"], r"--replicas 1; expected .* one replica reduces with nobody"),
    (["--replicas", "2", "--model", "cnn"], r"--replicas with --model cnn --device cpu --data digits.*use --model mlp"),
    (["--replicas", "2", "--reduce", "fp8"], r"--reduce='fp8', which is ambiguous"),
    (["--replicas", "2", "--reduce", "int8"], r"--reduce='int8', which is not a dtype gradients can be reduced in"),
    (["--replicas", "2", "--bandwidth", "fast"], r"bandwidth='fast'; expected bytes per second"),
    (["--replicas", "4", "--batch-size", "400"], r"--batch-size 400 on 4 replica\(s\).*at most 336"),
    (["--min-block-time", "inf"], r"--min-block-time inf; expected seconds from 0 to 60"),
    (["--min-block-time", "nan"], r"--min-block-time nan"),
    (["--seed", "-1"], r"--seed -1; expected a whole number from 0"),
    (["--compile", "yes"], r"--compile 'yes', which is not valid; expected any of: off, on"),
    (["--replicas", "2", "--data", "synthetic"], r"--data synthetic; the replica comparison trains the mlp on digits"),
    # options that would change nothing are refused, with the fix
    (["--reduce", "bfloat16"], r"--reduce bfloat16 without --replicas.*Add --replicas N"),
    (["--bandwidth", "10GB/s"], r"--bandwidth 10GB/s without --replicas"),
    (["--replicas", "2", "--compile", "on", "--repe", "5"],
     r"--compile on, --repeats 5 with --replicas: the replica comparison .* drop them"),
    (["--threads", "-1"], r"--threads -1; expected a whole number from 1 to this machine's \d+ cores, or 0"),
])
def test_bad_options_stop_before_any_run(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("mixedpolicy.bench.cli.has_nvidia_gpu", lambda: False)  # also on a GPU machine
    assert bench(args + ["--out", str(tmp_path / "out")]) == 2
    assert __import__("re").search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written


def test_an_out_that_is_a_file_or_read_only_is_refused_before_anything_is_written(capsys, tmp_path):
    import os

    afile = tmp_path / "results"
    afile.write_text("keep me")
    assert bench(["--out", str(afile)]) == 2
    assert "which is a file" in capsys.readouterr().err and afile.read_text() == "keep me"
    # a folder the system cannot make (here: under a file, which even root cannot) is said, not
    # a traceback; so for inspect, before it computes anything
    from mixedpolicy.bench import inspect_cli

    afile.chmod(0o755)
    for main in (bench, inspect_cli.main):
        assert main(["--out", str(afile / "out")]) == 2
        assert "cannot be" in capsys.readouterr().err and afile.read_text() == "keep me"
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permissions: the rest cannot be tested here
            return
        assert bench(["--out", str(locked / "out")]) == 2
        assert "cannot be written" in capsys.readouterr().err and list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_without_scikit_learn_the_bench_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert bench(["--frameworks", "torch", "--out", str(tmp_path / "out")]) == 2
    assert "scikit-learn cannot be imported" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_without_matplotlib_the_bench_says_so_first_and_still_prints_the_table(monkeypatch, capsys, tmp_path):
    from mixedpolicy.bench import cli as bench_cli, report

    record = {"framework": "torch", "policy": "float32", "model": "mlp", "batch_size": 64,
              "step_time_s": {"median": 1e-3}, "native_step_time_s": {"median": 1e-3},
              "throughput_samples_per_s": 64000.0, "peak_memory_bytes": 2**20, "final_loss": 0.5,
              "accuracy": 0.9, "skipped_steps": 0, "final_loss_scale": None,
              "timed_steps_per_block": 10, "overhead_vs_native": 1.0}
    monkeypatch.setattr(report, "can_plot", lambda: False)
    monkeypatch.setattr(report, "plots", lambda *a: pytest.fail("plots without matplotlib"))
    monkeypatch.setattr(bench_cli, "run_one", lambda spec: dict(record))
    assert bench(["--frameworks", "torch", "--policies", "float32", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "matplotlib is not installed" in err and "overhead vs native" in out
    assert (tmp_path / "results.json").exists() and not (tmp_path / "step_time.png").exists()


def test_a_framework_not_installed_names_the_installed_ones(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(spec, "missing_packages", lambda f: ["torch"] if "torch" in f else [])
    assert bench(["--frameworks", "keras-torch", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "keras-torch, but torch is not installed" in err and "jax, tensorflow, keras-jax" in err


def test_unknown_command_and_help(capsys):
    assert cli(["benchmark"]) == 2 and "expected one of: bench" in capsys.readouterr().err
    assert cli(["--help"]) == 0


def test_shared_weights_and_batch_order_are_deterministic():
    a, b = (models.init_weights("mlp", models.config("mlp", "cpu"), 0) for _ in range(2))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert a["dense0.kernel"].shape == (64, 128) and a["dense0.bias"].shape == (128,)
    order = batch_order(100, 32, 7, seed=0)
    assert order.shape == (7, 32) and (order == batch_order(100, 32, 7, seed=0)).all()
    assert (batch_order(100, 32, 12, seed=0)[:7] == order).all()  # a longer run extends the order
    assert len(set(order[:3].ravel())) == 96  # an epoch has no repeats
    with pytest.raises(ValueError, match="--batch-size 200"):
        batch_order(100, 200, 1)


class _Recording:
    """A fake trainer: each step takes `step_s` seconds (by the fake clock) and logs its batch."""

    def __init__(self, name, log, clock, step_s):
        self.name, self.log, self.clock, self.step_s = name, log, clock, step_s

    def step(self, x, y):
        self.log.append((self.name, int(y[0]), float(x[0, 0])))
        self.clock[0] += self.step_s

    def steps(self, batches):
        for x, y in batches:
            self.step(x, y)

    def sync(self):
        pass

    def last_loss(self):
        return 0.5

    def predict(self, x):
        return np.zeros((len(x), 10), np.float32)


def test_a_run_trains_both_sides_alike_then_times_them_in_interleaved_long_enough_blocks(monkeypatch, tmp_path):
    from mixedpolicy.bench import worker

    log, clock = [], [0.0]

    def trainers(model, cfg, policy, *args, **options):  # the reference: ours under float32
        ours = "ours" if policy == "mixed_bfloat16" else "reference"
        return (type("Ours", (_Recording, worker.Trainer), {})(ours, log, clock, 0.002 if ours == "ours" else 0.003),
                type("Native", (_Recording, worker.Trainer), {})("native", log, clock, 0.001))

    fake = type("runner", (), {"trainers": staticmethod(trainers)})
    monkeypatch.setattr(worker.runners, "load", lambda framework: fake)
    monkeypatch.setattr(worker.time, "perf_counter", lambda: clock[0])
    weights = tmp_path / "w.npz"
    models.save_weights(str(weights), models.init_weights("mlp", models.config("mlp", "cpu")))
    record = worker.run(spec.RunSpec("torch", "mixed_bfloat16", "mlp", 16, steps=10, repeats=5, warmup=2,
                                     device="cpu", weights=str(weights), seed=0, min_block_s=0.05))
    ours = [b for name, *b in log if name == "ours"]
    native = [b for name, *b in log if name == "native"]
    reference = [b for name, *b in log if name == "reference"]
    assert ours == native  # the same batches, in the same order
    assert reference == ours[:len(reference)]  # the reference walks the same batches from the start
    n = record["timed_steps_per_block"]
    assert 50 <= n <= 53  # the faster side's block lasts at least 0.05 s (estimated, 5% to spare)
    timed = log[-3 * 5 * n:]  # 5 timed triples, the order turning: ours, native, reference, reference...
    assert [timed[i][0] for i in range(0, len(timed), n)] == ["ours", "native", "reference"] + [
        "reference", "native", "ours", "ours", "native", "reference"] * 2
    assert record["step_time_s"]["median"] == pytest.approx(0.002)
    assert record["overhead_vs_native"] == pytest.approx(2.0) and len(record["overhead_ratios"]) == 5
    # the speed-up over float32 comes from the same blocks: the reference's time over ours
    assert record["speedup_vs_float32"] == pytest.approx(1.5) and record["speedup_ci"] == pytest.approx(0)
    assert record["loss_curve"][-1][0] == 2 + 10 and record["steps"] == 10 and record["repeats"] == 5
    # equal logits for every class: the held-out cross entropy is log(10) on both sides
    assert record["test_loss"] == pytest.approx(np.log(10)) and record["native_test_loss"] == pytest.approx(np.log(10))


def test_the_test_loss_is_the_held_out_cross_entropy_read_with_the_accuracy():
    """Read in batches (the last one short), in float64: logits far beyond float32's exp range
    give their exact cross entropy, and a synthetic run (labels of noise) reports neither."""
    from mixedpolicy.bench import worker

    logits = np.zeros((5, 10))
    logits[:, 0] = 1000.0  # class 0 everywhere, by a margin exp() cannot hold
    trainer = type("T", (), {"predict": lambda self, x: logits[x[:, 0].astype(int)]})()
    x = np.arange(5, dtype=np.float32)[:, None]
    y = np.array([0, 0, 3, 0, 3])
    run = spec.RunSpec("torch", "float32", "mlp", 2, 1, 1, 0, "cpu", "", 0)
    accuracy, loss = worker.evaluate(run, trainer, x, y)
    assert accuracy == pytest.approx(3 / 5)
    assert loss == pytest.approx(2 * 1000.0 / 5)  # 0 where class 0 is right, 1000 where it is not
    assert worker.evaluate(run._replace(dataset="synthetic"), trainer, x, y) == (None, None)


@pytest.mark.parametrize("elapsed_per_step, expected", [(0.1, 1), (0.02, 3), (1e-4, 525), (0.0, 1 << 20)])
def test_block_steps_reaches_the_minimum_block_time(elapsed_per_step, expected):
    from mixedpolicy.bench.worker import block_steps

    assert block_steps(lambda n: n * elapsed_per_step, 0.05) == expected  # a timer reading 0: capped


@pytest.mark.slow
def test_on_a_busy_machine_each_ratio_holds_or_the_run_says_it_is_noisy(tmp_path):
    """A second CPU-bound process runs throughout (a shared machine): the float32 A/A (ours against
    ours under float32, which must read 1) holds within 1.00 +- 0.03 or says it is noisy; every
    ratio shown without the flag is one whose interval can tell a few percent; and a flagged one
    says so in the table, the report and a warning, never a confident number. (How far ours sits
    from native is a speed goal, which the bench measures and docs/benchmarks.md records; a timed
    test does not assert it: the torch mixed_bfloat16 row's real cost, 1.04-1.07 by host, would
    make this test fail or pass by the machine it runs on.)"""
    from conftest import require_module

    require_module("torch")
    from mixedpolicy.bench.ratios import NOISE, noisy

    out = tmp_path / "out"
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        proc = subprocess.run([sys.executable, "-m", "mixedpolicy", "bench", "--frameworks", "torch",
                               "--policies", "float32,mixed_bfloat16", "--steps", "2", "--warmup", "2",
                               "--out", str(out)],  # the default timing: 31 repeats of 0.03 s blocks
                              capture_output=True, text=True, timeout=600)
    finally:
        busy.kill()
        busy.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["environment"]["load_average_at_start"] is not None
    report = (out / "report.md").read_text()
    for run in results["runs"]:
        assert run["overhead_vs_native"] > 0 and math.isfinite(run["overhead_ci"])
        # the overhead: shown as a number only with an interval that tells a few percent
        checks = [("overhead", run["overhead_ci"] <= NOISE["overhead"] * run["overhead_vs_native"])]
        if run["policy"] == "float32":
            checks.append(("speedup", abs(run["speedup_vs_float32"] - 1) <= 0.03))
        row = next(line for line in proc.stdout.splitlines() if line.startswith(f"torch      {run['policy']} "))
        for kind, holds in checks:
            assert holds or noisy(run, kind), (kind, run[f"{kind}_ci"], run)
            assert ("NOISY" in row) == any(noisy(run, k) for k in ("overhead", "speedup")), (row, run)
            if noisy(run, kind):  # said everywhere a reader looks
                assert "NOISY" in row and any(line.startswith("warning: torch") and f" {run['policy']}: " in line
                                              for line in proc.stderr.splitlines())  # the warnings' stream
                assert any("NOISY" in line for line in report.splitlines() if f"| {run['policy']} |" in line)
        # within the goal, or flagged: noisy, or steadily above it with the note saying why
        if round(run["overhead_vs_native"], 3) > run["overhead_goal"] and not noisy(run, "overhead"):
            assert "ABOVE GOAL" in row and any(line.startswith("note: ") and f"torch {run['policy']} " in line
                                               for line in proc.stderr.splitlines()), (row, proc.stderr)
            assert any("ABOVE GOAL" in line for line in report.splitlines() if f"| {run['policy']} |" in line)


@pytest.mark.slow
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
    assert {"versions", "device", "tf32", "date", "threads", "load_average_at_start",
            "load_average_at_end", "cpu"} <= set(results["environment"])
    assert results["environment"]["threads"]["intra_op_per_worker"] == 1
    assert all(r["threads"]["torch"] == 1 for r in results["runs"])  # read in the worker, not assumed
    assert [(r["framework"], r["policy"]) for r in results["runs"]] == [("torch", "float32"),
                                                                        ("torch", "mixed_float16")]
    for run in results["runs"]:
        assert FIELDS <= set(run), FIELDS - set(run)
        assert set(run["step_time_s"]) == {"median", "min", "max"}
        assert 0 <= run["accuracy"] <= 1 and run["overhead_vs_native"] > 0
        # both sides evaluated as they train (native under its autocast): the same held-out loss
        assert run["native_test_loss"] == pytest.approx(run["test_loss"], rel=1e-6), run["policy"]
    assert results["runs"][1]["final_loss_scale"] is not None
    assert "| torch | mixed_float16 |" in (out / "report.md").read_text()
    rows = (out / "results.csv").read_text().splitlines()
    assert rows[0].startswith("framework,compile,policy") and len(rows) == 3
    for png in ("overhead.png", "step_time.png", "speedup.png", "loss_torch.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    for run in results["runs"]:  # counted from the live tensors: float32 weights, gradients, momentum
        assert run["memory"]["ours"]["bytes_per_parameter"] == pytest.approx(12, abs=0.01)
        assert run["memory"]["native"]["parameters"] == run["memory"]["ours"]["parameters"] > 0


@pytest.mark.slow
def test_fp8_policies_run_against_each_frameworks_own_fp8_set_up(tmp_path):
    """torch's tensorwise row against torchao's own conversion, Keras's delayed row against
    model.quantize("float8"): the same weights and batches give the same losses (gap 0); Flax
    NNX's tensorwise row against the dot_general its users write by hand (the same layers, the
    same arithmetic: a gap within what bfloat16 rounding grows to); a recipe a framework has no
    set-up of its own for is left out there, and says so."""
    from conftest import require_module

    require_module("torchao")
    require_module("keras")
    require_module("jax")
    out = tmp_path / "out"
    # the transformer: attention's projections (EinsumDense in Keras) and the MLPs' Linear/Dense in fp8
    proc = subprocess.run([sys.executable, "-m", "mixedpolicy", "bench", "--frameworks", "torch,keras-jax,jax",
                           "--model", "transformer",
                           "--policies", "p=f32,c=bf16,float8=tensorwise,float8_from_mixed_bfloat16", "--steps", "4",
                           "--repeats", "2", "--warmup", "1", "--out", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "float8_from_mixed_bfloat16 is not run on torch, jax: no fp8 set-up" in proc.stderr
    runs = json.loads((out / "results.json").read_text())["runs"]
    tensorwise = "params=float32,compute=bfloat16,output=bfloat16,float8=tensorwise"
    assert [(r["framework"], r["policy"]) for r in runs] == [("torch", tensorwise), ("keras-jax", "float8_from_mixed_bfloat16"),
                                                             ("jax", tensorwise)]
    for run in runs:
        if run["framework"] == "jax":  # two programs: bfloat16's one-ulp differences, grown by fp8
            assert run["max_loss_gap_vs_native"] < 0.05, run
        else:
            assert run["max_loss_gap_vs_native"] == 0.0, run  # bit for bit with the framework's own fp8
        assert "float8" in run["native_recipe"], run["native_recipe"]
        # fp8 over its source policy, timed in the same interleaved blocks
        assert run["source_policy"] == "mixed_bfloat16" and run["speedup_vs_source"] > 0
        assert len(run["speedup_vs_source_ratios"]) == 2
        # a JAX worker runs on one core (runners.cores), read in the worker
        if run["framework"] != "torch" and len(__import__("os").sched_getaffinity(0)) > 1:
            assert len(run["threads"]["cores"]) == 1, run["threads"]
    assert "fp8 vs source" in proc.stdout


@pytest.mark.slow
def test_update_recipes_run_where_ours_trains_the_benchs_sgd_with_them(tmp_path):
    """A memory policy: ours rounds the bench's SGD stochastically (torch: the rule around its
    optimizer; JAX: the optax rule) against the framework's own pure bfloat16 training on the same
    weights (nearest); where ours carries no update recipe (TensorFlow) the row is left out and says so;
    bytes per parameter counted from the live tensors."""
    from conftest import require_module

    require_module("jax")
    require_module("torch")
    out = tmp_path / "out"
    require_module("tensorflow")
    proc = subprocess.run([sys.executable, "-m", "mixedpolicy", "bench", "--frameworks", "torch,jax,tensorflow",
                           "--policies", "p=bf16,rounding=stochastic;p=bf16,rounding=kahan",
                           "--steps", "4", "--repeats", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kahan = "params=bfloat16,compute=bfloat16,output=bfloat16,rounding=kahan"
    assert f"{kahan} is not run on tensorflow: ours does not train" in proc.stderr
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["framework"], r["policy"]) for r in runs] == [
        ("torch", "bfloat16_stochastic"), ("torch", kahan), ("jax", "bfloat16_stochastic"), ("jax", kahan)]
    for rounded in runs:
        assert "bfloat16" in rounded["native_recipe"]  # the framework's own pure bfloat16: nearest
        # weights, gradients and SGD's momentum, all bfloat16 (no float32 master); Kahan's
        # compensation, bfloat16 too, is two bytes more
        expected = 8 if rounded["policy"] == kahan else 6
        assert rounded["memory"]["ours"]["bytes_per_parameter"] == pytest.approx(expected, abs=0.01)
        assert rounded["overhead_vs_native"] > 0 and np.isfinite(rounded["final_loss"])
    with pytest.raises(ValueError, match="update recipe over one of them"):
        spec.resolve_policies("p=f64,state=float32")


def test_policies_split_where_jmp_parts_belong_together():
    from mixedpolicy.bench.spec import resolve_policies

    assert resolve_policies("float32,p=f32,c=bf16,float8=tensorwise,float8_from_mixed_bfloat16") == [
        "float32", "params=float32,compute=bfloat16,output=bfloat16,float8=tensorwise", "float8_from_mixed_bfloat16"]
    assert resolve_policies("p=f32,c=f16;bf16-mixed") == ["mixed_float16", "mixed_bfloat16"]
    with pytest.raises(ValueError, match="or an fp8 policy over one of float32"):
        resolve_policies("float8_from_bfloat16")


@pytest.mark.slow
def test_synthetic_data_at_the_models_shape_with_a_tf32_baseline_and_speed_ups(tmp_path):
    """gpt2 on synthetic tokens: throughput in tokens, no accuracy (the labels are noise),
    each run's speed-up over float32 measured in its own process (tf32 is float32 on a CPU)."""
    from conftest import require_module

    require_module("torch")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mixedpolicy", "bench", "--frameworks", "torch", "--model", "gpt2",
                           "--data", "synthetic", "--policies", "float32,tf32", "--steps", "2",
                           "--repeats", "2", "--warmup", "1", "--batch-size", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on synthetic" in proc.stdout and "tok/s" in proc.stdout and "vs float32" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert "synthetic" in results["environment"]["data"] and not (out / "digits_split.npz").exists()
    runs = {r["policy"]: r for r in results["runs"]}
    cfg = models.config("gpt2", "cpu", "synthetic")
    for run in runs.values():
        assert run["data"] == "synthetic" and run["accuracy"] is None and run["compile"] is False
        assert run["throughput_tokens_per_s"] == pytest.approx(run["throughput_samples_per_s"] * cfg["seq"])
        # ours under float32 against ours, block by block in this run's process
        ratios = run["speedup_ratios"]
        assert len(ratios) == 2 and run["speedup_vs_float32"] == pytest.approx(float(np.median(ratios)))
        assert "speedup_vs_tf32" not in run and np.isfinite(run["final_loss"])
    # the same weights and batches: tf32 is float32 on a CPU
    assert runs["tf32"]["final_loss"] == runs["float32"]["final_loss"]


def test_policies_in_every_spelling_and_the_spread_of_the_pair_ratios():
    from mixedpolicy.bench import report

    assert spec.resolve_policies("16-mixed, bf16-mixed,f32,tf32") == ["mixed_float16", "mixed_bfloat16",
                                                                      "float32", "tf32"]
    assert spec.resolve_policies("bf16-true,16-true,float16") == ["bfloat16", "float16"]
    with pytest.raises(ValueError, match=r"--policies 'float64' \(float64\); the bench runs policies that each "
                                         r"framework can also train with its own tools: choose among float32, "
                                         r"mixed_bfloat16, mixed_float16, bfloat16, float16, tf32"):
        spec.resolve_policies("float64")
    with pytest.raises(ValueError, match=r"'o=bf16' \(params=float32,compute=float32,output=bfloat16\)"):
        spec.resolve_policies("o=bf16")
    steady = {"framework": "torch", "policy": "float32", "overhead_vs_native": 1.0,
              "overhead_ratios": [0.99, 1.0, 1.0, 1.01, 1.0]}
    noisy = dict(steady, overhead_ratios=[0.5, 1.0, 2.0, 0.7, 1.6])
    assert report.spread(steady) == pytest.approx(0.01, abs=0.01) and report.spread(noisy) > 0.5
    assert report.wide([steady]) == [] and "too noisy" in report.wide([noisy])[0]
    # the flag: the median's 95% interval (1.57 IQR / sqrt(n)) wider than 3% of the overhead
    assert report.ratio(steady, "overhead") == (1.0, pytest.approx(1.57 * 0.01 / 5**0.5, abs=0.01))
    assert report.noise(steady) == "" and report.noise(noisy) == "NOISY overhead"
    assert report.noise(dict(steady, overhead_ratios=[1.0, 1.0])) == "NOISY overhead"  # too few to tell
    slow = dict(steady, policy="mixed_bfloat16", speedup_vs_float32=0.3, speedup_ratios=[0.3, 0.29, 0.31, 0.3, 0.3])
    assert report.noise(slow) == "" and report.noise(dict(slow, speedup_ratios=[0.2, 0.4, 0.3, 0.25, 0.35])) == \
        "NOISY speed-up"
    # float32's own row is the A/A check: a tight interval around 1.035 is a bias, not a speed-up
    aa = dict(steady, speedup_vs_float32=1.035, speedup_ratios=[1.034, 1.035, 1.036, 1.035, 1.035])
    assert report.noise(dict(aa, speedup_vs_float32=1.01)) == "" and report.noise(aa) == "NOISY speed-up"
    assert "the A/A check (ours under float32 against ours) 1.035" in report.wide([aa])[0]
    # a steady overhead above DESIGN's goal (5% on a CPU, 3% on a GPU) is said, with what ours
    # does there that a native side without a loss scale does not; noise is left to the warning
    over = dict(steady, overhead_vs_native=1.07, overhead_ratios=[1.06, 1.07, 1.07, 1.08, 1.07], final_loss_scale=None)
    note, = report.above_goal([steady, over, dict(noisy, overhead_vs_native=1.2)], "cpu")
    assert note.startswith("note: overhead above the 5% goal: torch float32 1.070 +-")
    both, = report.above_goal([over, dict(over, policy="mixed_bfloat16")], "cpu")  # one note per reason
    assert "torch float32 1.070" in both and "torch mixed_bfloat16 1.070" in both
    assert "skips a non-finite step" in note and "skip_nonfinite=False" in note
    scaled, = report.above_goal([dict(over, final_loss_scale=32768.0)], "cpu")
    assert "skip_nonfinite=False" not in scaled and "both sides scale" in scaled  # both sides check there
    rounded, = report.above_goal([dict(over, policy="bfloat16_stochastic")], "cpu")
    assert "rounds each update" in rounded and "rounds" not in note
    assert report.above_goal([dict(over, overhead_vs_native=1.04, overhead_ratios=[1.04] * 5)], "cpu") == []
    assert "above the 3% goal" in report.above_goal([dict(over, overhead_vs_native=1.04)], "cuda")[0]
    # the table flags such a row too, against the goal the bench recorded with the run
    assert report.noise(dict(over, overhead_goal=1.05)) == "ABOVE GOAL" and report.noise(over) == ""
    assert report.noise(dict(over, overhead_goal=1.08)) == "" and report.above_goal([dict(over, overhead_goal=1.08)],
                                                                                   "cpu") == []
    assert report.noise(dict(noisy, overhead_vs_native=1.2, overhead_goal=1.05)) == "NOISY overhead"


def test_model_input_shapes_and_sizes():
    x = np.zeros((5, 64), np.float32)
    assert [models.inputs(m, x, models.config(m, "cpu")).shape for m in models.MODELS] == [
        (5, 64), (5, 8, 8, 1), (5, 8, 8), (5, 32, 32, 3), (5, 64, 64, 3), (5, 64)]
    assert models.config("transformer", "cpu")["blocks"] == 2 and models.config("transformer", "cuda")["blocks"] == 12
    blocks = models.resnet_blocks(models.config("resnet", "cuda"))
    assert len(blocks) == 9 and [b[3] for b in blocks] == [1, 1, 1, 2, 1, 1, 2, 1, 1]  # ResNet-20
    weights = models.init_weights("resnet", models.config("resnet", "cpu"))
    assert "stage1.block0.proj.kernel" in weights and "stage0.block0.proj.kernel" not in weights


def _parameters(weights: dict) -> int:
    return sum(v.size for k, v in weights.items() if not k.endswith((".mean", ".var")))


def test_the_gpu_scale_models_are_resnet50_and_gpt2_small():
    """The real sizes (counted from the shared weights, no framework needed): ResNet-50 has
    25.56M parameters (torchvision's count), GPT-2 small's blocks 85M (7.08M per block)."""
    cfg = models.config("resnet50", "cuda", "synthetic")
    assert cfg["image"] == 224 and cfg["classes"] == 1000
    assert _parameters(models.init_weights("resnet50", cfg)) == 25_557_032
    gpt = models.config("gpt2", "cuda", "synthetic")
    assert (gpt["vocab"], gpt["seq"], gpt["d_model"], gpt["blocks"], gpt["heads"]) == (50257, 1024, 768, 12, 12)
    small = {**gpt, "blocks": 1}
    weights = models.init_weights("gpt2", small)
    per_block = sum(v.size for k, v in weights.items() if k.startswith("block0."))
    assert per_block == 7_087_872  # GPT-2's 12 * d^2 + 13 * d weights per block
    assert weights["tok.embedding"].shape == (50257, 768) and weights["pos"].shape == (1024, 768)
    # digits keeps the quality task on every device: 64 pixel tokens, 17 intensities + 10 classes
    assert models.config("gpt2", "cuda")["vocab"] == 27 and models.config("gpt2", "cuda")["seq"] == 64


def test_digits_as_sentences_for_gpt2_and_synthetic_data_in_every_models_shape():
    x = np.array([[0.0, 0.5, 1.0] + [0.25] * 61], np.float32)
    tokens = models.inputs("gpt2", x)
    assert tokens.dtype == np.int32 and tokens[0, :4].tolist() == [0, 8, 16, 4]
    labels = models.targets("gpt2", tokens, np.array([3], np.int32))
    assert labels[0, :3].tolist() == [8, 16, 4] and labels[0, -1] == models.CLASS_TOKEN + 3
    logits = np.zeros((1, 64, 27), np.float32)
    logits[0, -1, models.CLASS_TOKEN + 3] = 1.0
    assert models.class_logits("gpt2", logits).argmax(-1).tolist() == [3]
    for model in models.MODELS:
        cfg = models.config(model, "cpu", "synthetic")
        x_train, y_train, x_test, y_test = data.synthetic(model, cfg, 8, 4, seed=1)
        assert x_train.shape == (8, *models.input_shape(model, cfg)) and len(x_test) == 4
        again = data.synthetic(model, cfg, 8, 4, seed=1)
        assert all((a == b).all() for a, b in zip((x_train, y_train), again[:2]))
        if model == "gpt2":  # the labels are the next tokens
            assert (y_train[:, :-1] == x_train[:, 1:]).all() and x_train.max() < cfg["vocab"]
        else:
            assert y_train.max() < cfg["classes"] and x_train.dtype == np.float32
    with pytest.raises(ValueError, match="expected one of: digits, synthetic"):
        models.config("mlp", "cpu", "imagenet")


@pytest.fixture(scope="module")
def _shared_weights(tmp_path_factory):
    from bench_models_helper import TINY

    folder = tmp_path_factory.mktemp("bench_weights")
    for model in models.MODELS:
        models.save_weights(str(folder / f"{model}.npz"), models.init_weights(model, TINY[model], seed=1))
    return folder


def _built(framework: str, weights) -> dict:
    """What bench_models_helper.py records for `framework`, in a process of its own."""
    helper = str(Path(__file__).with_name("bench_models_helper.py"))
    out = weights / f"{framework}.out.npz"
    if not out.exists():  # the reference is built once per pytest worker
        env = _worker_env(framework, "cpu")
        if framework == "keras-torch":  # its default threads, as the bench gives it (not the suite's one)
            for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                env.pop(name, None)
        proc = subprocess.run([sys.executable, helper, framework, str(weights), str(out)], capture_output=True,
                              text=True, env=env, timeout=900)
        assert proc.returncode == 0, f"{framework}:\n{proc.stderr[-3000:]}"
    return dict(np.load(out))


def test_workers_run_with_pinned_threads_and_say_so():
    """One intra-op thread per CPU worker by default, through every framework's own setting."""
    env = _worker_env("jax", "cpu")
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["TF_NUM_INTRAOP_THREADS"] == "1"
    assert "--xla_cpu_multi_thread_eigen=false" in env["XLA_FLAGS"]
    assert "OMP_NUM_THREADS" not in _worker_env("torch", "cpu", 0) or \
        _worker_env("torch", "cpu", 0)["OMP_NUM_THREADS"] == __import__("os").environ.get("OMP_NUM_THREADS")
    assert _worker_env("torch", "cpu", 2)["OMP_NUM_THREADS"] == "2"
    # XLA:CPU's own threads: a JAX worker is held to as many cores as it has threads
    from mixedpolicy.bench.runners import cores

    allowed = sorted(__import__("os").sched_getaffinity(0))
    for framework in ("jax", "keras-jax"):
        assert cores(framework, "cpu", 1) == ({allowed[-1]} if len(allowed) > 1 else None)
        assert cores(framework, "cpu", 0) is None and cores(framework, "cuda", 1) is None
    assert cores("torch", "cpu", 1) is None and cores("keras-torch", "cpu", 1) is None


@pytest.mark.slow
@pytest.mark.parametrize("framework", spec.FRAMEWORKS)
def test_every_framework_builds_the_same_model_from_the_shared_weights(framework, _shared_weights):
    """Each framework's models compute the same float32 logits from the shared weights as
    PyTorch's (the reference), ours and hand-written alike; one step gives the same loss; under
    a mixed or pure policy (each on two of the smaller models) ours and the hand-written version
    agree. One test per framework, so the suite's workers share them out."""
    if spec.missing_packages(framework) or spec.missing_packages("torch"):
        pytest.skip(f"needs {framework} and torch")
    from bench_models_helper import HALF

    if framework == "keras-torch" and _torch_cpu_capability() == "AVX2":
        # Keras's torch backend on AVX2-only CPUs: another gradient for the strided 1x1 shortcut
        # convolution than keras-jax and PyTorch (0.27 on a 0.5-scale kernel after one SGD step,
        # without mixedpolicy in the process), a crash with one OpenMP thread, and ResNet steps
        # of minutes that ran this helper past its 15-minute limit; seen 2026-11-25
        pytest.xfail("keras-torch on an AVX2-only CPU: Keras's torch backend miscomputes the strided 1x1 "
                     "convolution's gradient there (docs/benchmarks.md)")
    ref = _built("torch", _shared_weights)
    got = _built(framework, _shared_weights)
    for model in models.MODELS:
        key = f"{model}/float32"
        scale = np.abs(ref[f"{key}/ours"]).max()
        for which in ("ours", "native"):
            np.testing.assert_allclose(got[f"{key}/{which}"], ref[f"{key}/ours"], atol=1e-5 * scale,
                                       err_msg=f"{framework} {model} {which}")
        np.testing.assert_allclose(got[f"{key}/loss"], ref[f"{key}/loss"], rtol=1e-5, err_msg=f"{framework} {model}")
        # After the step: equal weights; batch norms' running variance is debiased alike
        # except Flax's, which keeps the biased one (eval logits move by ~1e-3).
        np.testing.assert_allclose(got[f"{key}/after"], ref[f"{key}/after"], atol=2e-3 * scale,
                                   err_msg=f"{framework} {model} after one step")
        for policy, tol in (("mixed_bfloat16", 0.06), ("mixed_float16", 0.01), ("bfloat16", 0.1), ("float16", 0.02)):
            if policy not in HALF[model]:
                continue
            key = f"{model}/{policy}"
            assert np.isfinite(got[f"{key}/loss"]) and got[f"{key}/skipped"] == 0
            for which in ("ours", "native"):
                np.testing.assert_allclose(got[f"{key}/{which}"], ref[f"{model}/float32/ours"],
                                           atol=tol * scale, err_msg=f"{framework} {key} {which}")
            np.testing.assert_allclose(got[f"{key}/ours"], got[f"{key}/native"], atol=tol * scale / 2,
                                       err_msg=f"{framework} {key}: ours against hand-written")


def _torch_cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def test_the_hand_written_jax_step_skips_a_non_finite_step_as_jmp_does(tmp_path):
    """jmp's recipe selects the old parameters and optimizer state on an overflow; the
    native side must pay for that select as ours does (and not skip it)."""
    from conftest import require_module

    jax = require_module("jax")
    require_module("flax", "jax")
    import jax.numpy as jnp
    from flax import nnx

    from mixedpolicy.bench.runners import jax as jax_runner

    cfg = models.config("mlp", "cpu")
    native = jax_runner.trainers("mlp", cfg, "mixed_float16", models.init_weights("mlp", cfg), "cpu")[1]
    x = np.random.default_rng(0).random((8, 64), np.float32)
    y = np.arange(8, dtype=np.int32)

    def values():
        return [np.asarray(v) for v in jax.tree_util.tree_leaves((nnx.state(native.model), nnx.state(native.optimizer)))]

    start = values()
    native.scale = jnp.asarray(np.inf, jnp.float32)  # every gradient overflows
    native.step(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(start, values()))
    native.scale = jnp.asarray(2.0**15, jnp.float32)
    native.step(x, y)
    assert not all(np.array_equal(a, b) for a, b in zip(start, values()))


def test_the_hand_written_nnx_fp8_hook_is_ours_within_float32_rounding_over_a_float32_source():
    """The JAX fp8 row's native side (the dot_general NNX users write by hand) and ours run the
    same arithmetic: over float32 compute their gradients agree to float32 rounding (bit for bit
    on the machine this was written on; two programs, so not asserted), so the loss gap the bench
    shows over a bfloat16 source is the two programs' bfloat16 rounding that fp8's coarse steps
    grow, not a different recipe (another weight format moves them by percents)."""
    from conftest import require_module

    jax = require_module("jax")
    require_module("flax", "jax")
    import jax.numpy as jnp
    from flax import nnx

    from mixedpolicy.bench.runners import jax as jax_runner

    cfg = models.config("mlp", "cpu")
    ours, native = jax_runner.trainers("mlp", cfg, "p=f32,c=f32,float8=tensorwise", models.init_weights("mlp", cfg),
                                       "cpu")
    rng = np.random.default_rng(0)
    x, y = jnp.asarray(rng.random((64, 64), np.float32)), jnp.asarray(np.arange(64, dtype=np.int32) % 10)

    def grads(trainer):
        tree = nnx.grad(lambda m: jax_runner._loss(m, x, y))(trainer.model)
        return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}

    a, b = grads(ours), grads(native)
    assert a.keys() == b.keys() and len(a) == 6
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-5 * np.abs(b[key]).max(), err_msg=key)
    # and fp8 is at work: on the two hidden layers (not the head), whose gradients it changes
    import mixedpolicy as mp

    assert [row.path for row in mp.describe(ours.model) if row.runs_float8] == ["layers.0", "layers.1"]
    plain = grads(jax_runner.trainers("mlp", cfg, "float32", models.init_weights("mlp", cfg), "cpu")[0])
    assert not any(np.array_equal(a[key], plain[key]) for key in a if "['layers'][0]" in key or "['layers'][1]" in key)


def test_the_runner_table_says_what_each_framework_needs_and_how_its_process_starts():
    from mixedpolicy.bench import runners

    assert spec.FRAMEWORKS == runners.FRAMEWORKS and len(set(runners.FRAMEWORKS)) == len(runners.RUNNERS)
    for row in runners.RUNNERS:
        env = runners.environment(row.framework, "cpu")
        assert env["JAX_PLATFORMS"] == "cpu" and env["CUDA_VISIBLE_DEVICES"] == ""
        assert env.get("KERAS_BACKEND") == (row.keras_backend or os.environ.get("KERAS_BACKEND"))
        assert row.module.startswith("mixedpolicy.bench.runners.")
    assert runners.environment("keras-torch", "cuda")["KERAS_BACKEND"] == "torch"
    assert runners.environment("torch", "cuda").get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    with pytest.raises(ValueError, match="'mxnet'; expected one of: torch, jax"):
        runners.runner("mxnet")


@pytest.mark.slow
def test_replicas_compare_reduce_dtypes_with_bytes_per_step(tmp_path, capsys):
    """--replicas 2: the mlp on two JAX host devices, per reduce dtype: the table, the files,
    bytes in the ratio 4 : 1 (+ scales), accuracy well above chance."""
    pytest.importorskip("optax")
    out = tmp_path / "out"
    assert bench(["--replicas", "2", "--steps", "16", "--warmup", "1", "--policies", "mixed_bfloat16",
                  "--reduce", "float32,e5m2,fastest,adaprec", "--bandwidth", "10MB/s", "--out", str(out)]) == 0
    runs = json.loads((out / "replicas.json").read_text())["runs"]
    assert [(r["reduce_dtype"], r["replicas"]) for r in runs] == [
        ("float32", 2), ("float8_e5m2", 2), ("fastest", 2), ("adaprec", 2)]
    f32, fp8 = (r["bytes_per_step"] for r in runs[:2])
    assert runs[0]["comm_seconds"] == pytest.approx(runs[0]["bytes_total"] / 10e6)
    assert runs[2]["bytes_per_step"] < fp8  # weights in table-1, biases in float32
    ada = runs[3]
    steps = [step for step, _ in ada["decisions"]]
    rolled_back = {step for step, _ in ada["rollbacks"]}
    # every interval of 16 // 4 steps (counted after the warm-up step), or at a rollback
    assert steps[0] == 0 and len(steps) >= 4
    assert all(b - a >= 4 - (a == 0) or b in rolled_back for a, b in zip(steps, steps[1:])), ada["decisions"]
    assert {choice for _, choice in ada["decisions"]} <= {"float32", "float8_e5m2", "table-1"}
    assert [d["choice"] for d in ada["decision_log"]] == [c for _, c in ada["decisions"]]
    assert all(set(d["scores"]) <= {"float32", "float8_e5m2", "table-1"} for d in ada["decision_log"])
    for r in runs:  # the learning curve: (step, loss, accuracy, bytes so far, modelled seconds)
        assert r["curve"][-1][0] == 16 and r["curve"][-1][3] == r["bytes_total"]
        assert all(a[3] <= b[3] and a[4] <= b[4] for a, b in zip(r["curve"], r["curve"][1:]))
    if __import__("importlib").util.find_spec("matplotlib"):
        assert (out / "replicas_curves.png").read_bytes()[:4] == b"\x89PNG"
    n = f32 // 4
    assert fp8 == n + 4 * 6  # one byte a value, a float32 scale for each of the six tensors
    assert all(r["accuracy"] > 0.5 and np.isfinite(r["final_loss"]) for r in runs)
    assert "| mixed_bfloat16 | float8_e5m2 | 2 |" in capsys.readouterr().out
    assert (out / "replicas.md").read_text().startswith("| policy | reduce |")


@pytest.mark.slow
def test_compile_puts_both_sides_through_torch_compile_with_the_eager_numbers(tmp_path):
    from conftest import require_module

    require_module("torch")
    from mixedpolicy.bench.runners import torch as torch_runner

    cfg = models.config("mlp", "cpu")
    weights = models.init_weights("mlp", cfg)
    x = np.random.default_rng(0).random((16, 64), np.float32)
    y = np.arange(16, dtype=np.int32) % 10
    losses = {}
    for compiled in (False, True):
        ours, native = torch_runner.trainers("mlp", cfg, "float32", weights, "cpu", compile=compiled)
        assert (type(ours.model).__name__ == "OptimizedModule") == compiled
        assert (type(native.model).__name__ == "OptimizedModule") == compiled
        for _ in range(3):
            ours.step(x, y)
            native.step(x, y)
        losses[compiled] = (ours.last_loss(), native.last_loss())
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)


USER_MODELS = Path(__file__).with_name("user_models.py")


def test_a_user_model_is_checked_before_any_run(tmp_path, capsys):
    pytest.importorskip("torch")
    out = str(tmp_path / "out")
    assert bench(["--model", f"{USER_MODELS}:nope", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "has no callable 'nope'; its callables: dict_whose_model_fails" in err and "keras_mlp" in err, err
    assert bench(["--model", f"{USER_MODELS}:not_a_model", "--out", out]) == 2
    assert ("returns a int; the bench runs a user's torch.nn.Module, Flax NNX module or Keras 3 model"
            in capsys.readouterr().err)
    assert bench(["--model", f"{USER_MODELS}:torch_mlp", "--frameworks", "jax", "--out", out]) == 2
    assert "a torch model; leave --frameworks out or pass torch" in capsys.readouterr().err
    assert bench(["--model", f"{USER_MODELS}:torch_mlp", "--data", "synthetic", "--out", out]) == 2
    assert "a user's model trains on digits" in capsys.readouterr().err
    assert bench(["--model", f"{USER_MODELS}:raises", "--out", out]) == 2
    assert "whose factory raised RuntimeError: no GPU here; it must build the model" in capsys.readouterr().err
    assert bench(["--model", f"{USER_MODELS}:torch_wrong_width", "--out", out]) == 2
    assert ("fails on a batch of digits' features, float32 of shape (2, 64): RuntimeError"
            in capsys.readouterr().err)
    assert bench(["--model", f"{USER_MODELS}:torch_seven_classes", "--out", out]) == 2
    assert "maps a (2, 64) batch to shape (2, 7); the bench trains it on digits and expects (2, 10)" in \
        capsys.readouterr().err
    # the dict contract: what is wrong with the dict, and the fix
    for factory, message in (
            ("dict_without_batches", "with neither of 'batch' and 'batches'; give one"),
            ("dict_with_a_bad_pair", "whose batch 0 is a tuple of length 3; expected an (inputs, targets) pair"),
            ("dict_with_unknown_keys", "with the keys 'optimizer'; expected only 'model', 'batch', 'batches', 'loss'"),
            ("dict_whose_model_fails", "whose model and loss fail on its first batch: RuntimeError")):
        assert bench(["--model", f"{USER_MODELS}:{factory}", "--out", out]) == 2
        err = capsys.readouterr().err
        assert message in err, err
    assert bench(["--model", f"{USER_MODELS}:dict_with_a_bad_pair", "--batch-size", "8", "--out", out]) == 2
    assert bench(["--model", f"{USER_MODELS}:hf_gpt2", "--batch-size", "8", "--out", out]) == 2
    assert "whose factory brings its own batches (their size is the batch size); drop --batch-size" in \
        capsys.readouterr().err
    if not spec.missing_packages("jax"):
        assert bench(["--model", f"{USER_MODELS}:linen_mlp", "--out", out]) == 2
        assert "a Flax linen module has no state of its own" in capsys.readouterr().err
        if importlib.util.find_spec("equinox"):  # each kind the bench does not run, with its own way out
            assert bench(["--model", f"{USER_MODELS}:equinox_mlp", "--out", out]) == 2
            err = capsys.readouterr().err
            assert "an Equinox model has no framework-made mixed precision" in err and "linen" not in err, err
        # float32 needs no dtype arguments; a half policy's hand-written side does
        assert bench(["--model", f"{USER_MODELS}:nnx_without_dtype", "--policies", "float32,bf16-true",
                      "--out", out]) == 2
        err = capsys.readouterr().err
        assert "nnx_without_dtype() takes no dtype or param_dtype keyword argument" in err, err
        assert "give the factory `dtype=None, param_dtype=jnp.float32`" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("factory, framework, policies, flags", [
    ("torch_mlp", "torch", "float32,16-mixed", []),
    # (each run costs a process; the NNX model's half-precision sides are checked in process
    # by docs/benchmarks.md's block, Keras's by test_every_framework_builds_the_same_model...)
    ("nnx_mlp", "jax", "f32", []),
    # KERAS_BACKEND unset below: --frameworks says which backend Keras builds the model on
    ("keras_mlp", "keras-torch", "float32", ["--frameworks", "keras-torch"]),
])
def test_a_user_model_runs_against_the_frameworks_own_from_the_same_weights(tmp_path, factory, framework,
                                                                             policies, flags):
    if spec.missing_packages(framework):
        pytest.skip(f"needs {framework}")
    out = tmp_path / "out"
    # JAX's default promotion, as users run it (the suite's strict one trips Flax's own
    # LayerNorm under param_dtype=bfloat16: flax/nnx/nn/normalization.py promotes implicitly)
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"} | {"JAX_NUMPY_DTYPE_PROMOTION": "standard"}
    proc = subprocess.run([sys.executable, "-m", "mixedpolicy", "bench", "--model", f"{USER_MODELS}:{factory}",
                           "--policies", policies, "--steps", "4", "--repeats", "2", "--warmup", "1",
                           "--out", str(out), *flags], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())["runs"]
    named = [spec.resolve_policies(p)[0] for p in policies.split(",")]
    assert [(r["framework"], r["policy"]) for r in runs] == [(framework, p) for p in named]
    # ours and native start from one build of the factory: the same float32 accuracy
    assert runs[0]["accuracy"] == runs[0]["native_accuracy"]
    assert all(np.isfinite(r["final_loss"]) and r["skipped_steps"] == 0 for r in runs)
    assert runs[-1]["native_recipe"] == {"torch": "torch.autocast(torch.float16) + GradScaler", "jax": "float32",
                                         "keras-torch": "Keras dtype policy 'float32'"}[framework]


@pytest.mark.slow
@pytest.mark.parametrize("factory, frameworks, policies", [
    # a Hugging Face model on torch: dict inputs of token ids, the default loss on its .logits
    ("hf_gpt2", "torch", "float32,16-mixed"),
    # a timm model on torch: images of its own shape (batch, 3, 32, 32); float32 (a CPU without
    # bf16 kernels takes seconds per half-precision step of a convolution net)
    ("timm_resnet", "torch", "float32"),
    # a Flax NNX model taking two inputs, with a loss of its own (no accuracy: float targets)
    ("nnx_regression", "jax", "float32,mixed_bfloat16"),
    # a keras-hub model on every Keras backend, from one build's weights
    ("keras_hub_classifier", "keras-jax,keras-torch,keras-tensorflow", "float32"),
])
def test_a_user_model_with_its_own_batches_and_loss(tmp_path, factory, frameworks, policies):
    names = frameworks.split(",")
    needs = {"hf_gpt2": "transformers", "keras_hub_classifier": "keras_hub", "timm_resnet": "timm"}.get(factory)
    found = (zoo_helper.ZOO / "timm").is_dir() or importlib.util.find_spec("timm") if needs == "timm" else (
        needs is None or importlib.util.find_spec(needs))
    if any(spec.missing_packages(f) for f in names) or not found:
        pytest.skip(f"needs {frameworks} and {needs}")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"} | {"JAX_NUMPY_DTYPE_PROMOTION": "standard"}
    flags = ["--frameworks", frameworks] if factory != "nnx_regression" else []  # inferred: jax
    proc = subprocess.run([sys.executable, "-m", "mixedpolicy", "bench", "--model", f"{USER_MODELS}:{factory}",
                           "--policies", policies, "--steps", "3", "--repeats", "2", "--warmup", "1",
                           "--min-block-time", "0", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on its own batches" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    assert [(r["framework"], r["policy"]) for r in runs] == [(f, p) for f in names for p in policies.split(",")
                                                           for p in [spec.resolve_policies(p)[0]]]
    size = {"hf_gpt2": 8, "nnx_regression": 16, "keras_hub_classifier": 8, "timm_resnet": 8}[factory]
    assert all(r["own_data"] and r["batch_size"] == size and np.isfinite(r["final_loss"]) for r in runs)
    assert not (out / "digits_split.npz").exists()
    # the report says what was fed: the factory's batches and their size, never digits or --batch-size's default
    assert results["environment"]["batch_size"] == size and all(r["data"] == "own batches" for r in runs)
    # a language model's batches of token ids: tokens a second, as for the built-in gpt2
    assert all(("throughput_tokens_per_s" in r) == (factory == "hf_gpt2") for r in runs)
    text = (out / "report.md").read_text()
    assert f", batch {size}," in text and "Data: the factory's own batches" in text and "digits" not in text
    if factory == "nnx_regression":
        assert all(r["accuracy"] is None for r in runs)  # float targets: no classes to hit
    else:
        assert all(0 <= r["accuracy"] <= 1 for r in runs)
        # ours and native start from the same build: the same float32 accuracy
        assert all(r["accuracy"] == r["native_accuracy"] for r in runs if r["policy"] == "float32")
    # every row reports its loss gap to native, overhead, speed-up over float32 and memory,
    # and its accuracy gap to float32 where its targets are classes
    for r in runs:
        assert np.isfinite(r["max_loss_gap_vs_native"]) and r["overhead_vs_native"] > 0, r
        assert r["speedup_vs_float32"] > 0 and r["peak_memory_bytes"] > 0, r
        assert r["memory"]["ours"]["bytes_per_parameter"] > 0 and r["memory"]["native"]["bytes_per_parameter"] > 0
        assert (r.get("accuracy_gap_vs_float32") is None) == (factory == "nnx_regression"), r
    # the same weights and batches: the first loss agrees on every framework and policy
    first = [r["loss_curve"][0][1] for r in runs]
    np.testing.assert_allclose(first, first[0], rtol=2e-2)


def test_on_a_narrow_terminal_the_table_splits_into_whole_columns_that_fit(monkeypatch, capsys):
    import shutil

    from mixedpolicy.bench import progress

    run = {"framework": "torch", "policy": "mixed_float16", "step_time_s": {"median": 1e-3},
           "native_step_time_s": {"median": 1e-3}, "throughput_samples_per_s": 64000.0, "peak_memory_bytes": 2**20,
           "final_loss": 0.5, "accuracy": 0.9, "skipped_steps": 0, "final_loss_scale": 32768.0,
           "timed_steps_per_block": 10, "overhead_vs_native": 1.0, "overhead_ratios": [1.0] * 5}
    monkeypatch.setattr(progress.sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=None: os.terminal_size((60, 24)))
    progress.print_table("plain", [run])
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert len(lines) > 2 and all(len(line) <= 60 for line in lines)
    assert sum(line.startswith("framework  policy") for line in lines) >= 2  # every part repeats the key
    assert any("overhead vs native" in line for line in lines)


def test_a_factory_module_that_imports_keras_at_its_top_builds_on_the_backend_asked_for(tmp_path):
    """The module is imported after --frameworks is read, so `import keras` at its top takes the
    backend asked for (whatever KERAS_BACKEND the shell has), and the model is checked there."""
    if spec.missing_packages("keras-jax"):
        pytest.skip("needs keras and jax")
    factory = tmp_path / "top_level_keras.py"
    factory.write_text("import keras\n\nBACKEND = keras.backend.backend()\n\n\ndef make():\n"
                       "    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])\n")
    code = (f"import keras_backend_probe\n"  # nothing of Keras imported before the factory module
            f"from mixedpolicy.bench.spec import user_model_info\n"
            f"info = user_model_info({str(factory) + ':make'!r}, ['keras-jax'])\n"
            f"import keras\n"
            f"print(info.frameworks, keras.backend.backend(), sorted(info.weights)[:2])")
    (tmp_path / "keras_backend_probe.py").write_text("import sys\nassert 'keras' not in sys.modules\n")
    env = dict(os.environ, KERAS_BACKEND="tensorflow", PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "['keras-jax'] jax ['keras.0', 'keras.1']", proc.stdout


def test_each_jax_trainer_compiles_its_own_steps():
    """One nnx.jit function shared by several live models grows slower with each model built
    after the first (+9% for the second on the MLP): the bench's ours, native and float32
    reference would then be timed unequally by build order (the A/A check read 1.10)."""
    from conftest import require_module

    require_module("jax")
    require_module("flax", "jax")
    from mixedpolicy.bench.runners import jax as jax_runner

    cfg = models.config("mlp", "cpu")
    weights = models.init_weights("mlp", cfg)
    ours, native = jax_runner.trainers("mlp", cfg, "float32", weights, "cpu")
    reference = jax_runner.trainers("mlp", cfg, "float32", weights, "cpu")[0]
    compiled = [t.steps_of.ours for t in (ours, native, reference)]
    assert len({id(f) for f in compiled}) == 3
