"""The outputs of `mixedpolicy bench`: results.json, results.csv, report.md and the figures (plots.py)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
from typing import Any, Sequence

from mixedpolicy.bench import ratios, recipes
from mixedpolicy.bench.ratios import NOISE, a_over_a, goal, noisy, ratio
from mixedpolicy.bench.spec import loss_figure, run_label as label

_PACKAGES = ("mixedpolicy", "numpy", "torch", "jax", "jaxlib", "flax", "optax", "tensorflow-cpu",
             "tensorflow", "keras", "scikit-learn")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: the CPU features that decide what half precision and fp8 cost on a CPU
_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")


def cpu_features() -> list[str]:
    """Which of `_FEATURES` the CPU has (/proc/cpuinfo's flags; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [name for name in _FEATURES if name in flags]
    except OSError:
        pass
    return []


def numpy_blas() -> str:
    """The BLAS numpy was built with (its own build report)."""
    import numpy as np

    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name')} {blas.get('version', '')}".strip()
    except Exception:  # an older numpy's report has another layout: say so, never fail the bench
        return "unknown"


def load_average() -> list | None:
    """The machine's 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment(args: Any, frameworks: list[str], runs: Sequence[dict] = ()) -> dict:
    """What the runs ran on and with; a user's factory that brought its own batches sets the
    batch size and the data (never --batch-size's default or digits, which it did not use)."""
    own = [r for r in runs if r.get("own_data")]
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "platform": platform.platform(), "cpu": _cpu(),
        "cpu_count": os.cpu_count(), "cpu_features": cpu_features(), "numpy_blas": numpy_blas(),
        "device": args.device, "versions": versions,
        "tf32": "off (pinned in every run but the tf32 baseline's, Keras's included: torch "
                "allow_tf32=False for matmuls and cuDNN, JAX matmul precision 'highest' off the CPU, "
                "TF enable_tensor_float_32_execution(False))",
        "frameworks": frameworks, "model": args.model,
        "batch_size": own[0]["batch_size"] if own else args.batch_size,
        "steps": args.steps, "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed,
        "min_block_time_s": args.min_block_time,
        "data": ("the factory's own batches, cycled in order (accuracy: its targets hit by the logits' argmax, "
                 "where they are class indices)" if own else
                 "scikit-learn digits, 75/25 split (random_state=seed)" if args.data == "digits" else
                 "synthetic: seeded random inputs and labels in the model's shape (speed and memory "
                 "only; no accuracy)"),
        "compile": args.compile,
        "threads": ({"intra_op_per_worker": args.threads, "pinned_through": "OMP/MKL/OPENBLAS_NUM_THREADS, "
                     "TF_NUM_INTRAOP_THREADS (inter-op 1), XLA --xla_cpu_multi_thread_eigen=false at 1, "
                     "a JAX worker held to as many cores (sched_setaffinity)"}
                    if args.threads else "each framework's default (not pinned)"),
        "load_average_at_end": load_average(),
        "peak_memory": "device memory allocated (CUDA), else the worker process's peak RSS",
    }


def quality(runs: list[dict]) -> None:
    """Adds to each run its quality in one number each: the largest gap of its loss curve to
    native's (relative), and its accuracy against the float32 run of the same framework and
    compile setting (same weights, same batches: deterministic, so two processes may be
    compared here; speed is never compared across processes)."""
    for run in runs:
        gaps = [abs(p[1] - p[2]) / max(abs(p[2]), 1e-12) for p in run.get("loss_curve") or () if len(p) > 2]
        run["max_loss_gap_vs_native"] = max(gaps) if gaps else None
        ref = [r for r in runs if r["policy"] == "float32" and r["framework"] == run["framework"]
               and r.get("compile") == run.get("compile")]
        both = ref and ref[0].get("accuracy") is not None and run.get("accuracy") is not None
        run["accuracy_gap_vs_float32"] = run["accuracy"] - ref[0]["accuracy"] if both else None


def _throughput(run: dict) -> str:
    if "throughput_tokens_per_s" in run:
        return f"{run['throughput_tokens_per_s']:.0f} tok/s"
    return f"{run['throughput_samples_per_s']:.0f}/s"


def spread(run: dict) -> float:
    """The interquartile range of the run's (ours / native) pair ratios."""
    ratios = run.get("overhead_ratios") or [run["overhead_vs_native"]]
    if len(ratios) < 4:
        return max(ratios) - min(ratios)
    q = statistics.quantiles(ratios, n=4)
    return q[2] - q[0]


def noise(run: dict) -> str:
    """The table's flag: which of the run's ratios cannot tell a few percent, and an overhead
    steadily above the goal (the bench records each run's; the note under the table says why)."""
    flagged = [name for kind, name in (("overhead", "overhead"), ("speedup", "speed-up"),
                                       ("speedup_vs_source", "fp8")) if noisy(run, kind)]
    said = ["NOISY " + "+".join(flagged)] if flagged else []
    if ratios.above_goal(run):
        said.append("ABOVE GOAL")
    return ", ".join(said)


def wide(runs: list[dict]) -> list[str]:
    """A warning per run whose ratios are too noisy to conclude."""
    out = []
    for r in runs:
        said = []
        for kind, name in (("overhead", "overhead"), ("speedup", "speed-up over float32"),
                           ("speedup_vs_source", f"fp8 speed-up over {r.get('source_policy')}")):
            if noisy(r, kind):
                value, ci = ratio(r, kind)
                if a_over_a(r, kind):
                    said.append(f"the A/A check (ours under float32 against ours) {value:.3f} " +
                                ("(too few repeats for an interval)" if ci is None else
                                 f"+-{ci:.3f} (should read 1.00 +-{NOISE['overhead']:.0%})"))
                    continue
                said.append(f"{name} {value:.3f} " + ("(too few repeats for an interval)" if ci is None else
                                                      f"+-{ci:.3f} (wider than +-{NOISE[kind]:.0%})"))
        if said:
            out.append(f"warning: {label(r)} {r['policy']}: {', '.join(said)}: too noisy to tell a few "
                       f"percent; rerun on an idle machine, with more --repeats or a longer --min-block-time.")
    return out


def above_goal(runs: list[dict], device: str) -> list[str]:
    """A note per reason for the runs whose overhead is above the goal and not noise (interval
    within +-3%), naming them with their figures and saying what ours does there that the
    native side does not: one note for the rows that share a reason, short enough to read."""
    grouped: dict = {}
    for r in runs:
        if not ratios.above_goal(r, device):
            continue
        value, ci = ratio(r, "overhead")
        why = ("; both sides scale the loss and skip a non-finite step; ours also caps the scale (max_scale) and "
               "counts the skipped steps (its skip counters), which the native side does not"
               if r.get("final_loss_scale") is not None else
               "; the native side applies every step as it comes, ours checks each step's gradients and "
               "skips a non-finite step (skip_nonfinite=False gives the plain step): a few fixed kernels and "
               "one read of every gradient a step, which shows where the step is short or the update is a "
               "large part of it (many parameters, small batches)")
        if recipes.memory_policy(r["policy"]):  # the native side rounds to nearest in the weights' dtype
            why += "; ours also rounds each update as the policy says, which the native side does not"
        key = (r.get("overhead_goal", goal(device)), why)
        grouped.setdefault(key, []).append(f"{label(r)} {r['policy']} {value:.3f} +-{ci or 0:.3f}")
    return [f"note: overhead above the {bound - 1:.0%} goal: {', '.join(rows)}{why} (docs/benchmarks.md)."
            for (bound, why), rows in grouped.items()]


def _ratio(run: dict, kind: str, digits: int, unit: str = "") -> str:
    value, ci = ratio(run, kind)
    if value is None:
        return "-"
    return f"{value:.{digits}f}{unit}" + ("" if ci is None else f" +-{ci:.{digits}f}")


def _bytes_per_parameter(run: dict) -> str:
    mem = run.get("memory") or {}
    ours, native = mem.get("ours"), mem.get("native")
    if not ours:
        return "-"
    return f"{ours['bytes_per_parameter']:.1f}" + (f" ({native['bytes_per_parameter']:.1f})" if native else "")


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


#: (header, cell) of every column; a column that says nothing in these runs is left out.
_COLUMNS = (
    ("framework", label),
    ("policy", lambda r: r["policy"]),
    ("step ms", lambda r: f"{r['step_time_s']['median'] * 1e3:.2f}"),
    ("throughput", _throughput),
    ("vs float32", lambda r: _ratio(r, "speedup", 2, "x")),
    ("fp8 vs source", lambda r: _ratio(r, "speedup_vs_source", 2, "x")),
    ("overhead vs native", lambda r: _ratio(r, "overhead", 3)),
    ("flag", noise),
    ("peak MB", lambda r: f"{r['peak_memory_bytes'] / 2**20:.0f}"),
    ("B/param (native)", _bytes_per_parameter),
    ("loss gap", lambda r: _percent(r.get("max_loss_gap_vs_native"))),
    ("accuracy", lambda r: "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}"),
    ("test loss", lambda r: "-" if r.get("test_loss") is None else f"{r['test_loss']:.4f}"),
    ("vs f32 acc", lambda r: "-" if r.get("accuracy_gap_vs_float32") is None
     else f"{r['accuracy_gap_vs_float32']:+.3f}"),
    ("skipped", lambda r: str(r["skipped_steps"])),
    ("final scale", lambda r: "-" if r["final_loss_scale"] is None else f"{r['final_loss_scale']:g}"),
)


def columns(runs: list[dict]) -> list:
    quality(runs)
    return [(h, cell) for h, cell in _COLUMNS if any(cell(r) not in ("-", "") for r in runs)
            or h in ("framework", "policy", "overhead vs native")]


def table(runs: list[dict]) -> str:
    chosen = columns(runs)
    rows = [[h for h, _ in chosen]] + [[cell(r) for _, cell in chosen] for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(chosen))]
    return "\n".join("  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     .rstrip() for row in rows)


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = ["# mixedpolicy bench", "",
             f"{env['date']}; {env['model']}, batch {env['batch_size']}, {env['warmup']} warm-up + "
             f"{env['steps']} training steps per run, then {env['repeats']} timed pairs of blocks of "
             f"at least {env['min_block_time_s']} s; device {env['device']} "
             f"({env['cpu']}, {env['cpu_count']} cores); Python {env['python']}; "
             + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + f"; TF32 {env['tf32']}.", "",
             f"Data: {env['data']}.", ""]
    chosen = columns(results["runs"])
    lines += ["| " + " | ".join(h for h, _ in chosen) + " |", "|" + "---|" * len(chosen)]
    lines += ["| " + " | ".join(cell(r) for _, cell in chosen) + " |" for r in results["runs"]]
    said = wide(results["runs"]) + above_goal(results["runs"], env["device"])
    lines += [""] + [f"> {w}" for w in said] if said else []
    recipes = {(label(r), r["policy"]): r["native_recipe"] for r in results["runs"] if r.get("native_recipe")}
    if recipes:
        lines += ["", "What each run's native side is (the same model and policy written with the "
                  "framework's own tools):", "", "| framework | policy | native |", "|---|---|---|"]
        lines += [f"| {f} | {p} | {recipe} |" for (f, p), recipe in recipes.items()]
    lines += ["", "Loss, accuracy, skipped steps and scale come from the training steps, the same "
              "schedule on every framework. Then ours and the same model and policy written with "
              "the framework's own tools are timed in pairs of blocks of `timed block` steps, "
              "interleaved in the same process: step times are medians over the blocks (ours), "
              "`overhead vs native` the median of the pairs' ratios; `vs float32` is ours under "
              "float32 (same weights, same batches) over ours under the policy, timed in the same "
              "blocks of the same process (float32's own row is the A/A check: ours against ours). "
              "Each ratio carries the half width of its median's 95% interval (1.57 x IQR / sqrt(n)); "
              "`flag`: NOISY where a ratio's interval is wider than +-3% (it cannot tell a few percent), "
              "ABOVE GOAL where the overhead is steadily above the goal (the note says what ours does "
              "there). "
              "`loss gap`: the largest gap of ours's loss curve to native's; `test loss`: the mean cross "
              "entropy on the held-out test split after training (read with the accuracy); `vs f32 acc`: "
              "accuracy against the float32 run; `B/param`: bytes per parameter of weights, gradients and "
              "optimizer state, counted from the live arrays, ours (native). On CPUs without bf16/fp16 "
              "hardware, half precision is slower than float32: that is the hardware; the overhead "
              "ratio is the figure that measures mixedpolicy there.", "",
              "![overhead against native](overhead.png)", "", "![step times, ours and native](step_time.png)", "",
              "![speed-up over float32](speedup.png)", ""]
    lines += [f"![loss curves, {f}]({loss_figure(f)})" for f in
              dict.fromkeys(label(r) for r in results["runs"] if r.get("loss_curve"))] + [""]
    return "\n".join(lines)


def plots(results: dict, out: str) -> list[str]:
    from mixedpolicy.bench.plots import write_all

    return write_all(results, out)


def can_plot() -> bool:
    """Is matplotlib installed (checked before the runs, so its absence is said up front)?"""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def csv_rows(runs: list[dict]) -> list[list]:
    """One row per run: its headline numbers, for spreadsheets."""
    header = ["framework", "compile", "policy", "model", "data", "batch_size", "step_ms", "native_step_ms",
              "throughput_per_s", "peak_memory_mb", "bytes_per_parameter", "speedup_vs_float32", "speedup_ci",
              "final_loss", "max_loss_gap_vs_native", "accuracy", "test_loss", "accuracy_gap_vs_float32",
              "skipped_steps", "final_loss_scale", "overhead_vs_native", "overhead_ci", "flag"]
    rows = [header]
    for r in runs:
        rows.append([r["framework"], r.get("compile", False), r["policy"], r["model"], r.get("data", "digits"),
                     r["batch_size"], r["step_time_s"]["median"] * 1e3, r["native_step_time_s"]["median"] * 1e3,
                     r.get("throughput_tokens_per_s", r["throughput_samples_per_s"]),
                     r["peak_memory_bytes"] / 2**20, ((r.get("memory") or {}).get("ours") or {}).get(
                         "bytes_per_parameter"), *ratio(r, "speedup"), r["final_loss"],
                     r.get("max_loss_gap_vs_native"), r["accuracy"], r.get("test_loss"),
                     r.get("accuracy_gap_vs_float32"),
                     r["skipped_steps"], r["final_loss_scale"], *ratio(r, "overhead"), noise(r)])
    return rows


def write(results: dict, out: str, with_plots: bool = True) -> list[str]:
    import csv

    quality(results["runs"])
    csv_path = os.path.join(out, "results.csv")
    with open(csv_path, "w", newline="") as f:
        csv.writer(f).writerows(csv_rows(results["runs"]))
    json_path = os.path.join(out, "results.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=2)
    md_path = os.path.join(out, "report.md")
    with open(md_path, "w") as f:
        f.write(markdown(results))
    return [json_path, csv_path, md_path] + (plots(results, out) if with_plots else [])
