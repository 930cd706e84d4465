"""`AdaPrec`: choose the gradient-communication precision as training goes, by speculation.

The AdaPrec study's method, on any training loop whose step takes the reduce choice as an
argument: every `interval` steps, from the current state, it trains `speculative_steps`
steps under each candidate (the same batches for each), fits each candidate's short
learning curve, predicts the loss it would reach `interval` steps on, and picks the
candidate with the best predicted loss decrease per second (among those whose predicted
decrease is at least `min_relative_gain` of the best one), where a step's seconds are its
compute time plus the bytes it sends over the given bandwidth. The chosen candidate's
speculative steps are kept as training steps (its state goes on; the others' states are
dropped), so speculation costs only the candidates not chosen. Every decision is logged.

The learning-curve model: ``loss(k) = a + b * log(k)`` for the k-th speculative step,
fitted by least squares (numpy), evaluated at ``k = interval``; it needs no scipy, is
exact for the power-law curves training losses follow at this scale
(``log loss ~ -c log k`` near a plateau), and never extrapolates upward for a
decreasing curve. Candidates are whatever the step accepts: reduce dtypes, `Policy`
objects, or a `PolicyMap` giving each layer its own (the study's "Fastest").
"""

from __future__ import annotations

import math
import re
import time
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bandwidth(value: Any) -> float:
    """Bytes per second from a number or a string such as ``"14GiB/s"``, ``"100 Gbit/s"``.

    Raises:
      ValueError: not a positive finite bandwidth.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        rate = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMgGtT]i?)?\s*(B|bit|b)\s*/\s*s\s*", value)
        if m is None:
            raise ValueError(f"Received bandwidth={value!r}; expected bytes per second or a string "
                             f"such as '14GiB/s', '100Gbit/s' or '1.5 MB/s'.")
        rate = float(m[1]) * _UNITS[(m[2] or "").lower()] / (8 if m[3] in ("bit", "b") else 1)
    else:
        raise TypeError(f"Received bandwidth={value!r} of type {type(value).__name__}; expected "
                        f"bytes per second or a string such as '14GiB/s'.")
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"Received bandwidth={value!r}; expected a finite bandwidth > 0.")
    return rate


def predict_loss(losses: Sequence[float], at: int) -> float:
    """The fitted ``a + b log(k)`` of `losses` (k = 1, 2, ...) evaluated at step `at`.

    >>> round(predict_loss([1.0, 0.8, 0.7], at=9), 3) < 0.7
    True
    """
    y = np.asarray(losses, np.float64)
    if y.size == 0 or not np.all(np.isfinite(y)):
        return math.inf  # a candidate whose speculative run diverged is never chosen
    if y.size == 1:
        return float(y[0])
    k = np.log(np.arange(1, y.size + 1, dtype=np.float64))
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(k), k], axis=1), y, rcond=None)
    predicted = float(a + min(b, 0.0) * math.log(at))  # a rising fit predicts no gain, not a loss
    # a loss that was never negative is not predicted below 0 (a steep start extrapolates far)
    return max(predicted, 0.0) if np.all(y >= 0) else predicted


def fit_noise(losses: Sequence[float]) -> float:
    """The standard deviation of `losses` around their fitted ``a + b log(k)`` (0 for fewer
    than three points): how far a candidate's predicted gain is noise."""
    y = np.asarray(losses, np.float64)
    if y.size < 3 or not np.all(np.isfinite(y)):
        return 0.0
    k = np.log(np.arange(1, y.size + 1, dtype=np.float64))
    design = np.stack([np.ones_like(k), k], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    return float(np.sqrt(np.sum((y - design @ coef) ** 2) / (y.size - 2)))


def _diverged(recent: Sequence[float], reference: float, window: int, factor: float) -> bool:
    """Is the mean loss of the last `window` steps above `factor` times `reference` (the mean
    loss of the `window` steps before the choice), or not finite?"""
    tail = float(np.mean(recent[-window:]))
    return not math.isfinite(tail) or tail > factor * reference


def _key(candidate: Any) -> str:
    return candidate if isinstance(candidate, str) else str(candidate)


class Decision(NamedTuple):
    """One AdaPrec decision: at `step`, each candidate's predicted loss, seconds per step and
    score (predicted loss decrease per second); the `choice`."""

    step: int
    losses: dict
    predicted: dict
    seconds_per_step: dict
    scores: dict
    choice: Any


class AdaPrec:
    """Speculative, periodic choice of the gradient-communication precision.

    Args:
      candidates: what the step takes as its reduce choice (reduce dtypes, policies, maps).
      speculative_steps: steps each candidate trains from the same state, per decision.
      interval: steps between decisions (and the horizon each prediction looks at).
      bytes_per_step: candidate -> bytes one replica sends per step.
      bandwidth: bytes per second, or a string such as ``"14GiB/s"``.
      compute_seconds: seconds of compute per step; None measures each speculative run
        (wall time less what the bandwidth would add is not subtracted: on one machine
        the exchange is part of the measured time). A number makes decisions
        deterministic given the seeds.
      min_relative_gain: a candidate competes only if its predicted loss decrease is at
        least this fraction of the best candidate's (0 lets the cheapest candidate win on
        any gain; a short curve can look fine for a codec that will stall or diverge).
      divergence: in `run`, where the loss since the last decision climbs above this factor
        of the loss the choice started from (or is not finite; checked every
        `speculative_steps` steps), the state goes back to that decision and the choice is
        made again without that candidate, which is not chosen again in the run (logged in
        `rollbacks` and `banned`); None never rolls back.
      snapshot, restore: how to keep and bring back the training state around
        speculation; the defaults suit immutable state (JAX pytrees): the same object.

    Raises:
      ValueError: no candidates, or a count that is not a whole number >= 1.
    """

    def __init__(self, candidates: Iterable[Any], *, speculative_steps: int = 5, interval: int = 50,
                 bytes_per_step: Callable[[Any], int], bandwidth: Any = "14GiB/s",
                 compute_seconds: float | None = None, min_relative_gain: float = 0.5,
                 divergence: float | None = 1.5,
                 snapshot: Callable[[Any], Any] = lambda state: state,
                 restore: Callable[[Any], Any] = lambda saved: saved):
        if isinstance(candidates, (str, bytes)) or not hasattr(candidates, "__iter__"):
            raise TypeError(f"Received candidates={candidates!r:.60} of type {type(candidates).__name__}; "
                            f"expected an iterable of reduce choices, e.g. ('float32', 'float8_e5m2', "
                            f"'table-1') (a single string would be taken letter by letter).")
        self.candidates = list(candidates)
        if not self.candidates:
            raise ValueError("Received no candidates; expected at least one reduce choice, "
                             "e.g. ('float32', 'float8_e5m2', 'table-1').")
        for name, value in (("speculative_steps", speculative_steps), ("interval", interval)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Received {name}={value!r}; expected a whole number >= 1.")
        if speculative_steps > interval:
            raise ValueError(f"Received speculative_steps={speculative_steps} > interval={interval}; "
                             f"speculation must fit between two decisions.")
        if compute_seconds is not None and not (compute_seconds >= 0 and math.isfinite(compute_seconds)):
            raise ValueError(f"Received compute_seconds={compute_seconds!r}; expected seconds >= 0 or None.")
        self.speculative_steps, self.interval = speculative_steps, interval
        self.bytes_per_step, self.bandwidth = bytes_per_step, parse_bandwidth(bandwidth)
        if divergence is not None and not divergence > 1:
            raise ValueError(f"Received divergence={divergence!r}; expected a factor > 1, or None.")
        self.divergence = divergence
        self.rollbacks: list[tuple[int, Any]] = []  # (step, the candidate rolled back)
        self.banned: list[Any] = []  # candidates rolled back in `run`: not chosen again
        if not 0 <= min_relative_gain <= 1:
            raise ValueError(f"Received min_relative_gain={min_relative_gain!r}; expected a fraction from 0 to 1.")
        self.compute_seconds, self.min_relative_gain = compute_seconds, min_relative_gain
        self._snapshot, self._restore = snapshot, restore
        self.decisions: list[Decision] = []
        self.choice = self.candidates[0]
        self.speculated: Any = None  # the chosen candidate's state after the last speculation

    def _seconds(self, candidate: Any, measured: float) -> float:
        compute = self.compute_seconds if self.compute_seconds is not None else measured
        return compute + self.bytes_per_step(candidate) / self.bandwidth

    def decide(self, step: int, state: Any, batches: Sequence[Any],
               train_step: Callable[[Any, Any, Any], tuple], banned: Sequence[Any] = ()) -> Any:
        """Speculates from `state` on `batches` under each candidate (but `banned`), records
        and returns the choice; `state` itself is left as it was (each candidate starts from
        ``restore(snapshot(state))``), and the chosen candidate's state after `batches` is
        `speculated` (a snapshot)."""
        saved = self._snapshot(state)
        losses, predicted, seconds, scores, ends = {}, {}, {}, {}, {}
        start_loss = None
        for index, candidate in enumerate(self.candidates):
            if candidate in banned and len(banned) < len(self.candidates):
                continue
            current, curve = self._restore(saved), []
            t0 = time.perf_counter()
            for batch in batches:
                current, loss = train_step(current, batch, candidate)
                curve.append(float(loss))
            measured = (time.perf_counter() - t0) / max(len(batches), 1)
            if start_loss is None:
                start_loss = curve[0]
            key = _key(candidate)
            ends[key] = self._snapshot(current)
            losses[key], predicted[key] = curve, predict_loss(curve, self.interval)
            seconds[key] = self._seconds(candidate, measured)
            scores[key] = (start_loss - predicted[key]) / (self.interval * seconds[key])
        keys = list(scores)
        assert start_loss is not None  # at least one candidate ran (banned ones only where not all are)
        by_key = {_key(c): c for c in self.candidates}
        gains = {k: start_loss - predicted[k] for k in keys}
        top = max(gains.values())
        # gains closer to the best than the curves' own noise are the same gain: the cheaper
        # step wins among them (at a low loss, 4-step curves differ by noise alone)
        noise = 2.0 * float(np.median([fit_noise(losses[k]) for k in keys]))
        eligible = [i for i, k in enumerate(keys)
                    if top <= 0 or gains[k] >= min(self.min_relative_gain * top, top - noise)]
        for k in keys:
            if gains[k] >= top - noise and top > 0:
                scores[k] = top / (self.interval * seconds[k])
        if top <= 0:  # no candidate is predicted to gain: the least time per step
            best = min(range(len(keys)), key=lambda i: (seconds[keys[i]], i))
        else:
            best = max(eligible, key=lambda i: (scores[keys[i]], -i))  # ties: the earlier
        self.choice = by_key[keys[best]]
        self.speculated = ends[keys[best]]
        self.decisions.append(Decision(step, losses, predicted, seconds, scores, self.choice))
        return self.choice

    def run(self, state: Any, batches: Iterable[Any], train_step: Callable[[Any, Any, Any], tuple]
            ) -> Iterator[tuple[int, Any, float, Any]]:
        """Trains over `batches`, deciding every `interval` steps; yields (step, state, loss,
        choice) after each step. Speculation uses the next `speculative_steps` batches; the
        chosen candidate's speculative steps are training steps (yielded with the state after
        the last of them), so training goes on from there."""
        batches = list(batches)
        step, since, saved = 0, None, None
        recent: list[float] = []
        history: list[float] = []
        while step < len(batches):
            if saved is not None and self._climbing(recent):
                # the last choice made the loss climb: back to where it was chosen, and that
                # candidate is not chosen again in this run
                state = self._restore(saved)
                self.rollbacks.append((step, self.choice))
                self.banned.append(self.choice)
                since = None
            if since is None or since >= self.interval:
                saved = self._snapshot(state)
                ahead = batches[step:step + self.speculative_steps]
                self.decide(step, self._restore(saved), ahead, train_step, self.banned)
                state = self._restore(self.speculated)
                recent = list(self.decisions[-1].losses[_key(self.choice)])
                before = history[-self._window():] or recent[:1]
                self._reference = float(np.mean(before))
                history += recent
                for loss in recent:
                    yield step, state, loss, self.choice
                    step += 1
                since = len(recent)
                continue
            state, loss = train_step(state, batches[step], self.choice)
            recent.append(float(loss))
            history.append(float(loss))
            yield step, state, float(loss), self.choice
            step += 1
            since += 1

    def _window(self) -> int:
        """Steps whose mean loss the divergence check compares: a quarter interval, at least
        `speculative_steps` (single batch losses are too noisy at a low loss)."""
        return max(self.speculative_steps, self.interval // 4)

    def _climbing(self, recent: Sequence[float]) -> bool:
        """Checked every `speculative_steps` steps once a window of them is in (not only at
        the next decision), so a diverging choice is caught soon after it shows."""
        if (self.divergence is None or len(recent) < self._window()
                or len(recent) % self.speculative_steps):
            return False
        return _diverged(recent, self._reference, self._window(), self.divergence)
