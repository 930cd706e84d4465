"""The bench's ratios (overhead against native, speed-up over float32) and how far to trust
them: the median's approximate 95% interval, and the noise flag it sets."""

from __future__ import annotations

import math
import statistics


#: a ratio whose median's 95% interval reaches further than this (relative, either side) is
#: flagged noisy: the overhead cannot then tell a few percent, the speed-up a few more
NOISE = {"overhead": 0.03, "speedup": 0.05, "speedup_vs_source": 0.05}


def goal(device: str) -> float:
    """DESIGN's bound on the overhead against the framework's own tools: 5% on a small CPU
    model, 3% on a GPU."""
    return 1.05 if device == "cpu" else 1.03


def above_goal(run: dict, device: str | None = None) -> bool:
    """Is the run's overhead steadily above the goal: over it, with an interval narrow enough
    to tell (a noisy one is flagged as noise instead)? The goal is the one the bench recorded
    with the run (`overhead_goal`), else `device`'s; with neither, there is none to be above."""
    value, _ = ratio(run, "overhead")
    bound = run.get("overhead_goal", goal(device) if device else None)
    return value is not None and bound is not None and round(value, 3) > bound and not noisy(run, "overhead")


def median_ci(ratios: list[float]) -> float | None:
    """The half width of an approximate 95% confidence interval of the median of `ratios`
    (McGill's notch: 1.57 x IQR / sqrt(n)); None with fewer than 4 ratios (too few to tell)."""
    if len(ratios) < 4:
        return None
    q = statistics.quantiles(ratios, n=4)
    return 1.57 * (q[2] - q[0]) / math.sqrt(len(ratios))


_RATIOS = {"overhead": ("overhead_vs_native", "overhead_ratios"),
           "speedup": ("speedup_vs_float32", "speedup_ratios"),
           # an fp8 row: ours under its source policy (e.g. mixed_bfloat16) over ours in fp8
           "speedup_vs_source": ("speedup_vs_source", "speedup_vs_source_ratios")}


def ratio(run: dict, kind: str) -> tuple[float | None, float | None]:
    """(median, half width of its 95% interval) of a run's "overhead" (ours / native) or
    "speedup" (ours under float32 / ours), both measured block by block in its process."""
    value_key, ratios_key = _RATIOS[kind]
    value = run.get(value_key)
    if value is None:
        return None, None
    return value, run.get(f"{kind}_ci", median_ci(run.get(ratios_key) or []))


def a_over_a(run: dict, kind: str) -> bool:
    """Is this ratio the A/A check: float32's speed-up over ours under float32, which is 1?"""
    return kind == "speedup" and run.get("policy") == "float32"


def noisy(run: dict, kind: str) -> bool:
    """Can this ratio not tell a few percent? Its interval is too wide, or, for the A/A check,
    which must read 1, the interval or its miss of 1 passes the overhead's bound: a miss there
    is the measurement's own bias, which every ratio of the run shares."""
    value, ci = ratio(run, kind)
    if value is None:
        return False
    if a_over_a(run, kind):
        bound = NOISE["overhead"]
        return ci is None or ci > bound * value or abs(value - 1) > bound
    return ci is None or ci > NOISE[kind] * value
