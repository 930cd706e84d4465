"""The bench's figures, written beside results.json (matplotlib, no display needed), each meant
to be read in a few seconds:

- overhead.png: ours / native per framework and policy, a point at the median with whiskers
  at its 95% interval, 1.0 and the goal (DESIGN's 5% on a CPU, 3% on a GPU) marked; the
  axis spans the medians and the intervals of the rows that are not noisy, so one wild row
  cannot flatten the rest; a noisy row is grey and labelled, a steady one above the goal
  labelled, and a point beyond the axis sits on its edge with its value written;
- speedup.png: the speed-up over float32 the same way (ours under float32 / ours, measured
  in the same process), on a log axis;
- step_time.png: ours and native median step times side by side (log scale);
- loss_<framework>.png: one small multiple per policy, ours solid and native dashed.
"""

from __future__ import annotations

import os

from mixedpolicy.bench.ratios import above_goal, goal, noisy, ratio
from mixedpolicy.bench.spec import loss_figure, run_label as label

#: the widest an axis of ratios is allowed: beyond it, points are clipped to its edge
_CLIP = {"overhead": (0.5, 2.0), "speedup": (0.05, 20.0)}


def _groups(runs: list) -> tuple[list, list]:
    return list(dict.fromkeys(label(r) for r in runs)), list(dict.fromkeys(r["policy"] for r in runs))


def _points(ax, runs: list, kind: str, colors, log: bool = False) -> None:
    """One point per run at its median ratio, whiskers at its 95% interval; noisy runs grey."""
    frameworks, policies = _groups(runs)
    width = 0.8 / len(policies)
    # the axis spans every median and the whiskers of the rows that are not noisy, within _CLIP
    values = [v for r in runs for v in (_span(r, kind) if not noisy(r, kind) else [ratio(r, kind)[0]])
              if v is not None] or [1.0]
    low, high = min(min(values), 0.97), max(max(values), 1.03)
    pad = (high / low) ** 0.08 if log else (high - low) * 0.08
    low, high = (low / pad, high * pad) if log else (low - pad, high + pad)
    low, high = max(low, _CLIP[kind][0]), min(high, _CLIP[kind][1])
    for j, policy in enumerate(policies):
        for i, framework in enumerate(frameworks):
            for r in runs:
                value, ci = ratio(r, kind)
                if label(r) != framework or r["policy"] != policy or value is None:
                    continue
                x, grey = i + j * width, noisy(r, kind)
                color = "0.6" if grey else colors(j)
                shown = min(max(value, low), high)
                if ci is not None:
                    lo, hi = max(value - ci, low), min(value + ci, high)
                    ax.plot([x, x], [lo, hi], color=color, linewidth=1.5)
                ax.plot([x], [shown], "o", color=color, markersize=6)
                flagged = kind == "overhead" and above_goal(r)
                if grey or shown != value or flagged:
                    note = ("noisy " if grey else "above goal " if flagged else "") + (
                        f"{value:.2f}" if shown != value else "")
                    ax.annotate(note.strip(), (x, shown), textcoords="offset points", xytext=(4, 4),
                                fontsize=7, color="0.35")
    ax.set_ylim(low, high)
    if log:
        ax.set_yscale("log")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(policies) - 1) / 2 for i in range(len(frameworks))], frameworks,
                  rotation=15, ha="right")
    ax.set_xlim(-0.5, len(frameworks) - 0.5 + width * (len(policies) - 1))
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker="o", linestyle="", color=colors(j), label=p) for j, p in enumerate(policies)]
    if any(noisy(r, kind) for r in runs):
        handles.append(Line2D([], [], marker="o", linestyle="", color="0.6", label="noisy (any policy)"))
    ax.legend(handles=handles, fontsize=8)


def _span(run: dict, kind: str) -> list:
    value, ci = ratio(run, kind)
    return [] if value is None else [value] if ci is None else [value - ci, value + ci]


def write_all(results: dict, out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, env = results["runs"], results["environment"]
    frameworks, policies = _groups(runs)
    colors = plt.get_cmap("tab10")
    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = os.path.join(out, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(frameworks)), 4))
    _points(ax, runs, "overhead", colors)
    bound = goal(env["device"])
    ax.axhline(bound, color="0.5", linestyle="--", linewidth=0.8)
    ax.annotate(f"goal {bound:.2f}", (ax.get_xlim()[0], bound), textcoords="offset points", xytext=(2, 2),
                fontsize=7, color="0.35")
    ax.set_ylim(ax.get_ylim()[0], max(ax.get_ylim()[1], bound + 0.01))
    ax.set_ylabel("ours / native step time\n(median, whiskers: 95% interval)")
    ax.set_title(f"{env['model']}: overhead against the framework's own AMP", fontsize=10)
    save(fig, "overhead.png")

    if any(ratio(r, "speedup")[0] is not None for r in runs):
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(frameworks)), 4))
        _points(ax, runs, "speedup", colors, log=True)
        ax.set_ylabel("ours under float32 / ours\n(same process; < 1 is slower)")
        ax.set_title(f"{env['model']}: speed-up over float32 on this device", fontsize=10)
        save(fig, "speedup.png")

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(frameworks)), 4))
    width = 0.8 / len(policies)
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

    for framework in frameworks:
        mine = [r for r in runs if label(r) == framework and r.get("loss_curve")]
        if not mine:
            continue
        fig, axes = plt.subplots(1, len(mine), figsize=(3.2 * len(mine), 3), squeeze=False)
        for ax, r in zip(axes[0], mine):
            steps = [p[0] for p in r["loss_curve"]]
            ax.plot(steps, [p[1] for p in r["loss_curve"]], color="C0", label="ours")
            if len(r["loss_curve"][0]) > 2:
                ax.plot(steps, [p[2] for p in r["loss_curve"]], color="C1", linestyle="--", label="native")
            gap = r.get("max_loss_gap_vs_native")
            ax.set_title(r["policy"] + ("" if gap is None else f" (largest gap {100 * gap:.1f}%)"), fontsize=9)
            ax.set_xlabel("training step")
        axes[0][0].set_ylabel("training loss")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{env['model']} on {framework}: ours and native", fontsize=10)
        save(fig, loss_figure(framework))
    return paths
