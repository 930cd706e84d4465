"""`AdaPrec`: choose the gradient-communication precision as training goes, by speculation.

The AdaPrec study's method, on any training loop whose step takes the reduce choice as an
argument: every `interval` steps, from the current state, it trains `speculative_steps`
steps under each candidate (the same batches for each), restores the state, fits each
candidate's short learning curve, predicts the loss it would reach `interval` steps on,
and picks the candidate with the best predicted loss decrease per second, where a step's
seconds are its compute time plus the bytes it sends over the given bandwidth. Training
then goes on from the restored state with that choice. Every decision is logged.

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
    return float(a + min(b, 0.0) * math.log(at))  # a rising fit predicts no gain, not a loss


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
      snapshot, restore: how to keep and bring back the training state around
        speculation; the defaults suit immutable state (JAX pytrees): the same object.

    Raises:
      ValueError: no candidates, or a count that is not a whole number >= 1.
    """

    def __init__(self, candidates: Iterable[Any], *, speculative_steps: int = 5, interval: int = 50,
                 bytes_per_step: Callable[[Any], int], bandwidth: Any = "14GiB/s",
                 compute_seconds: float | None = None,
                 snapshot: Callable[[Any], Any] = lambda state: state,
                 restore: Callable[[Any], Any] = lambda saved: saved):
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
        self.compute_seconds = compute_seconds
        self._snapshot, self._restore = snapshot, restore
        self.decisions: list[Decision] = []
        self.choice = self.candidates[0]

    def _seconds(self, candidate: Any, measured: float) -> float:
        compute = self.compute_seconds if self.compute_seconds is not None else measured
        return compute + self.bytes_per_step(candidate) / self.bandwidth

    def decide(self, step: int, state: Any, batches: Sequence[Any],
               train_step: Callable[[Any, Any, Any], tuple]) -> Any:
        """Speculates from `state` on `batches` under each candidate, records and returns the
        choice; the state to go on from is ``restore(snapshot(state))`` (the same)."""
        saved = self._snapshot(state)
        losses, predicted, seconds, scores = {}, {}, {}, {}
        start_loss = None
        for index, candidate in enumerate(self.candidates):
            current, curve = self._restore(saved), []
            t0 = time.perf_counter()
            for batch in batches:
                current, loss = train_step(current, batch, candidate)
                curve.append(float(loss))
            measured = (time.perf_counter() - t0) / max(len(batches), 1)
            if start_loss is None:
                start_loss = curve[0]
            key = str(candidate) if not isinstance(candidate, str) else candidate
            losses[key], predicted[key] = curve, predict_loss(curve, self.interval)
            seconds[key] = self._seconds(candidate, measured)
            scores[key] = (start_loss - predicted[key]) / (self.interval * seconds[key])
        keys = list(scores)
        best = max(range(len(keys)), key=lambda i: (scores[keys[i]], -i))  # ties: the earlier
        self.choice = self.candidates[best]
        self.decisions.append(Decision(step, losses, predicted, seconds, scores, self.choice))
        return self.choice

    def run(self, state: Any, batches: Iterable[Any], train_step: Callable[[Any, Any, Any], tuple]
            ) -> Iterator[tuple[int, Any, float, Any]]:
        """Trains over `batches`, deciding every `interval` steps; yields (step, state, loss,
        choice) after each real step. Speculation uses the next `speculative_steps`
        batches, which the chosen candidate then trains on for real."""
        batches = list(batches)
        step = 0
        while step < len(batches):
            if step % self.interval == 0:
                ahead = batches[step:step + self.speculative_steps]
                state = self._restore(self._snapshot(state))
                self.decide(step, state, ahead, train_step)
            state, loss = train_step(state, batches[step], self.choice)
            yield step, state, float(loss), self.choice
            step += 1
