"""The bench's figures, written beside results.json (matplotlib, no display needed).

- overhead.png: ours / native per framework and policy, the median with the pair ratios'
  interquartile range as an error bar, 1.0 marked;
- step_time.png: ours and native median step times side by side (log scale);
- speedup.png: each policy's step time against the same framework's float32 run;
- loss_curves.png: one panel per framework, a colour per policy, ours solid and native
  dashed, the y-axis the training loss at the steps the quality phase recorded.
"""

from __future__ import annotations

import os
import statistics

from mixedpolicy.bench.spec import run_label as label


def _groups(runs: list) -> tuple[list, list]:
    return list(dict.fromkeys(label(r) for r in runs)), list(dict.fromkeys(r["policy"] for r in runs))


def _bars(ax, runs: list, value, error=None) -> None:
    frameworks, policies = _groups(runs)
    width = 0.8 / len(policies)
    for j, policy in enumerate(policies):
        xs, ys, errs = [], [], []
        for i, framework in enumerate(frameworks):
            for r in runs:
                if label(r) == framework and r["policy"] == policy and value(r) is not None:
                    xs.append(i + j * width)
                    ys.append(value(r))
                    errs.append(error(r) if error else (0, 0))
        yerr = [[e[0] for e in errs], [e[1] for e in errs]] if error else None
        ax.bar(xs, ys, width, yerr=yerr, capsize=3, label=policy)
    ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(frameworks))], frameworks,
                  rotation=15, ha="right")


def _iqr(r: dict) -> tuple:
    ratios = r.get("overhead_ratios") or [r["overhead_vs_native"]]
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else (min(ratios), 0, max(ratios))
    return max(r["overhead_vs_native"] - q[0], 0), max(q[2] - r["overhead_vs_native"], 0)


def write_all(results: dict, out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, env = results["runs"], results["environment"]
    frameworks, policies = _groups(runs)
    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = os.path.join(out, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(frameworks)), 4))
    _bars(ax, runs, lambda r: r["overhead_vs_native"], _iqr)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("ours / native step time (median; bar: IQR)")
    ax.set_title(f"{env['model']}: mixedpolicy's overhead against the framework's own AMP")
    ax.legend(fontsize=8)
    save(fig, "overhead.png")

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(frameworks)), 4))
    width = 0.8 / len(policies)
    colors = plt.get_cmap("tab10")
    for j, policy in enumerate(policies):
        for i, framework in enumerate(frameworks):
            for r in runs:
                if label(r) == framework and r["policy"] == policy:
                    x = i + j * width
                    ax.bar(x - width / 4, r["step_time_s"]["median"] * 1e3, width / 2, color=colors(j),
                           label=f"{policy} ours" if i == 0 else None)
                    ax.bar(x + width / 4, r["native_step_time_s"]["median"] * 1e3, width / 2, color=colors(j),
                           alpha=0.45, hatch="//", label=f"{policy} native" if i == 0 else None)
    ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(frameworks))], frameworks,
                  rotation=15, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"{env['model']}: step time, ours (solid) and native (hatched)")
    ax.legend(fontsize=7, ncol=2)
    save(fig, "step_time.png")

    if any(r.get("speedup_vs_float32") is not None for r in runs):
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(frameworks)), 4))
        _bars(ax, runs, lambda r: r.get("speedup_vs_float32"))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel("float32 step time / this policy's")
        ax.set_title(f"{env['model']}: speed-up over float32 (this device; < 1 is slower)")
        ax.legend(fontsize=8)
        save(fig, "speedup.png")

    fig, axes = plt.subplots(1, len(frameworks), figsize=(4 * len(frameworks), 3.5), squeeze=False, sharey=True)
    for ax, framework in zip(axes[0], frameworks):
        for j, policy in enumerate(policies):
            for r in runs:
                if label(r) == framework and r["policy"] == policy and r["loss_curve"]:
                    steps = [p[0] for p in r["loss_curve"]]
                    ax.plot(steps, [p[1] for p in r["loss_curve"]], color=colors(j), label=f"{policy} ours")
                    if len(r["loss_curve"][0]) > 2:
                        ax.plot(steps, [p[2] for p in r["loss_curve"]], color=colors(j), linestyle="--",
                                label=f"{policy} native")
        ax.set_title(framework)
        ax.set_xlabel("training step")
    axes[0][0].set_ylabel("training loss (batch at the recorded step)")
    axes[0][-1].legend(fontsize=7)
    save(fig, "loss_curves.png")
    return paths
