"""The gradient-norm guard: flag exploding gradients before they turn into NaN.

Pure host-side logic over one float per step (the total gradient norm, read in
the step's single host sync). A spike is judged against the run's own history:
it must be ``ratio`` times the median of the recent norms (which one outlier
cannot move; early in training, with little history, ``early_ratio`` times) *and*
twice the largest norm of the longer past. Gradients on their way to Inf grow
past everything seen before; the ordinary heavy-tailed noise of a converging
run (a hard batch when most of the data is fitted) does not. Each excursion is
reported once: the alarm re-arms when the norm is back under the limit.

A step whose batch is smaller than the run's (the short last batch of an epoch, a
batch size lowered mid-run) has a noisier gradient: its norm is judged (and
remembered) scaled by ``sqrt(batch / usual batch)``, the noise of a mean over fewer
samples, so that only a real rise is a spike.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from collections.abc import Callable
from typing import Final

__all__ = ["GradNormAlarm", "GradNormMonitor"]

_REARM: Final = 0.5  # back under half the limit: a new excursion can be reported


@dataclasses.dataclass(frozen=True)
class GradNormAlarm:
    """Why the norm was flagged."""

    reason: str  # "spike" or "threshold"
    norm: float
    reference: float | None  # the median it was compared with (None for a threshold)
    limit: float
    scale: float = 1.0  # the norm was judged as ``norm * scale`` (a smaller batch)


class GradNormMonitor:
    """Watches the total gradient norm of each step.

    Args:
        spike: detect spikes relative to the run's history.
        ratio: a norm this many times the recent median is a spike.
        early_ratio: the same before ``warmup`` steps of history exist.
        warmup: steps of history before ``ratio`` applies.
        settle: steps of history before which a step whose loss fell (``learning``) is
            judged with ``settle_ratio``: early training's norms rise several-fold as the
            loss leaves its first plateau; a diverging run's loss rises with its norm.
        window: how many recent norms the median looks at.
        memory: how many past norms the "largest so far" looks at (the first ``window``
            steps only until ``window`` later ones are known: early training's large norms
            would hide later spikes).
        threshold: an absolute limit on the total norm (``None``: none).

    Example:
        >>> m = GradNormMonitor()
        >>> [m.observe(n) for n in (1.0, 1.2, 0.9, 1.1, 1.0, 0.8)]
        [None, None, None, None, None, None]
        >>> m.observe(400.0).reason
        'spike'
    """

    def __init__(
        self,
        *,
        spike: bool = True,
        ratio: float = 3.0,
        early_ratio: float = 100.0,
        warmup: int = 5,
        settle: int = 20,
        settle_ratio: float = 10.0,
        window: int = 50,
        memory: int = 10_000,
        threshold: float | None = None,
    ) -> None:
        self.spike = spike
        self.ratio = ratio
        self.early_ratio = early_ratio
        self.warmup = warmup
        self.settle = settle
        self.settle_ratio = settle_ratio
        self.threshold = threshold
        self.history: collections.deque[float] = collections.deque(maxlen=window)
        self._sorted: list[float] = []  # the same values, kept sorted for the median
        self._past: collections.deque[float] = collections.deque(maxlen=memory)
        self._early: list[float] = []  # the first ``window`` norms (kept out of _past)
        self._armed = {"spike": True, "threshold": True}

    def reset(self) -> None:
        """Forget the norms seen (a guard attached again: a new run may follow, from new
        weights, whose norms the old ones say nothing about)."""
        self.history.clear()
        self._sorted = []
        self._past.clear()
        self._early = []
        self._armed = {"spike": True, "threshold": True}

    def reference(self) -> float | None:
        """The median of the recent finite norms (``None`` before any)."""
        s = self._sorted
        n = len(s)
        if not n:
            return None
        return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])

    def observe(
        self,
        norm: float,
        *,
        history: bool = True,
        scale: float | Callable[[], float] = 1.0,
        learning: bool = False,
    ) -> GradNormAlarm | None:
        """Take one step's total norm; return an alarm the first step it is too large.

        ``history=False``: gradients no step will apply (left in ``.grad`` when a guard
        detaches): only the absolute threshold is checked, and the norm is not remembered.
        ``scale``: the norm's spike is judged, and remembered, as ``norm * scale``
        (``sqrt(batch / usual batch)`` for a smaller batch, see the module's docstring);
        the absolute threshold applies to the norm itself. A callable is asked only for a
        norm above the recent median (a scale below 1 changes nothing else that matters).
        ``learning``: the step's loss fell well below the last step's.
        """
        if not math.isfinite(norm):
            return None  # non-finite gradients are reported as such, not as a spike
        alarm = None
        if self.threshold is not None:
            alarm = self._check("threshold", norm, None, self.threshold)
        if not history:
            return alarm
        reference = self.reference()
        if callable(scale):
            scale = scale() if reference is None or norm > reference else 1.0
        raw, norm = norm, norm * scale
        if self.spike and reference is not None:  # (None: no history yet)
            found = self._spike(norm, reference, learning)
            if found is not None and scale != 1.0:
                found = dataclasses.replace(found, norm=raw, scale=scale)
            alarm = alarm or found
        if len(self.history) == self.history.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self.history[0])]
        self.history.append(norm)
        bisect.insort(self._sorted, norm)
        if len(self._early) < (self.history.maxlen or 0):
            self._early.append(norm)  # (the first steps' norms: large, while training starts)
        else:
            self._past.append(norm)
        return alarm

    def _spike(self, norm: float, reference: float, learning: bool) -> GradNormAlarm | None:
        if reference <= 0:
            return None
        seen = len(self.history)
        ratio = self.ratio if seen >= self.warmup else self.early_ratio
        if learning and seen < self.settle:
            ratio = max(ratio, self.settle_ratio)
        limit = reference * ratio
        if norm <= limit:  # the usual step: no longer scan, no alarm (re-armed if well under)
            if norm < limit * _REARM:
                self._armed["spike"] = True
            return None
        # Only now is the longer scan worth it. The first steps' norms count until as many
        # later ones are known: large while training starts, they would hide a later
        # explosion for `memory` steps.
        window = self.history.maxlen or 0
        past = self._past if len(self._past) >= window else (*self._early, *self._past)
        limit = max(limit, 2.0 * max(past))
        return self._check("spike", norm, reference, limit)

    def _check(
        self, reason: str, norm: float, reference: float | None, limit: float
    ) -> GradNormAlarm | None:
        if norm > limit:
            if self._armed[reason]:
                self._armed[reason] = False
                return GradNormAlarm(reason, norm, reference, limit)
        elif norm < limit * _REARM:
            self._armed[reason] = True
        return None
