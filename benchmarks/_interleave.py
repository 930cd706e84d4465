"""Side-by-side timing shared by the overhead benchmarks: interleaved repeats, median ratio."""

import statistics
from typing import Callable, NamedTuple


class Comparison(NamedTuple):
    """Median seconds per step of ours and of the native version, and every repeat's ratio."""

    ours: float
    native: float
    ratios: list

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    def row(self, label: str) -> str:
        return (f"{label} {self.ours * 1e3:9.3f} {self.native * 1e3:10.3f} {self.ratio:7.3f} "
                f"{min(self.ratios):7.3f}..{max(self.ratios):.3f}")


HEADER = f"{'ours ms':>9s} {'native ms':>10s} {'ratio':>7s} {'ratio min..max':>16s}"


def interleave(ours: Callable[[], float], native: Callable[[], float], repeats: int) -> Comparison:
    """Times `ours` and `native` (each returns seconds per step) `repeats` times, alternating
    which goes first (ours, native, native, ours, ...), so drifts in the machine hit both."""
    t_ours, t_native, ratios = [], [], []
    for i in range(repeats):
        if i % 2 == 0:
            a, b = ours(), native()
        else:
            b, a = native(), ours()
        t_ours.append(a)
        t_native.append(b)
        ratios.append(a / b)
    return Comparison(statistics.median(t_ours), statistics.median(t_native), ratios)
