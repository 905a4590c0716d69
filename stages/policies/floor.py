"""A floor on bdsgd's c from what the next gradient has been worth: the record of arrivals.

Waiting for one more gradient pays for itself when it is likely to arrive soon. With few workers
(at most :data:`SMALL_N`), a model whose per-worker body is too wide (a tight run-time with rare
long spells read as a broad log-normal) sees a worker still out a few milliseconds after its
peers as probably late, and stops at an arrival where the gradient still out would have come in
a few milliseconds later: one gradient of a handful given up for almost no time.

:class:`ArrivalRecord` keeps, for each k, what followed the k-th arrival in recent iterations
(exponentially weighted, about the last 1 / ``alpha``): the share in which the (k+1)-th arrived
within ``TICK_S`` (the driver's first tick) and its mean gap then; an iteration cut at a tick
with the (k+1)-th still out counts as "late" for k; one cut at the k-th arrival says nothing of
the (k+1)-th and is left out. At the k-th arrival, waiting for one more (and, if it is late, being
asked again at the tick) is worth, at the going rate lambda,

    P(soon) (1 - lambda E[gap | soon])  -  P(late) lambda TICK_S

gradients more than stopping now. While that is positive the (k+1)-th pays for itself on the
record, and the policy does not stop at the k-th arrival whatever its model predicts; it still
stops at a tick, once a worker is observably late. :meth:`floor` moves a c to the first k >= c
whose next gradient does not pay. It is applied to every c the policy would stop at: the one
chosen before the iteration and every revision at an arrival (a training loop's rank that
takes the ticket of the standing c cuts the iteration itself, so the floor has to be in the c
that stands, not added at that rank's arrival).
"""

from __future__ import annotations

import numpy as np
from bdsgd.stages.policies.driver import TICK_S

SMALL_N = 16  # the record floors c on clusters of at most this many live workers
MIN_WEIGHT = 0.14  # a k's record counts once its weights sum to this (about 3 iterations)


class ArrivalRecord:
    """What followed each arrival in recent iterations (see the module docstring)."""

    def __init__(self, alpha: float = 0.05, tick_s: float = TICK_S) -> None:
        self.alpha, self.tick_s = alpha, tick_s
        self.weight = np.zeros(0)  # per k (index k - 1): weight of iterations that told
        self.soon = np.zeros(0)  # ... weighted share in which the (k+1)-th came within a tick
        self.gap = np.zeros(0)  # ... weighted sum of its gap then

    def _grow(self, n: int) -> None:
        if self.weight.size < n:
            pad = n - self.weight.size
            self.weight, self.soon, self.gap = (
                np.concatenate([a, np.zeros(pad)]) for a in (self.weight, self.soon, self.gap)
            )

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        """One iteration as the policy saw it: arrivals exactly, the rest censored at the cut."""
        runtimes = np.asarray(runtimes, dtype=float)
        done = ~np.asarray(censored, dtype=bool) & np.isfinite(runtimes) & (runtimes > 0)
        arrivals = np.sort(runtimes[done])
        m, n = arrivals.size, runtimes.size
        self._grow(n)
        if m == 0:
            return
        told = np.zeros(n, dtype=bool)
        soon = np.zeros(n)
        gap = np.zeros(n)
        gaps = np.diff(arrivals)
        told[: m - 1] = True
        soon[: m - 1] = gaps < self.tick_s
        gap[: m - 1] = np.where(gaps < self.tick_s, gaps, 0.0)
        out = ~done & np.isfinite(runtimes) & (runtimes > 0)
        if m < n and out.any() and runtimes[out].max() - arrivals[-1] >= self.tick_s - 1e-9:
            told[m - 1] = True  # cut at a tick: the (m+1)-th was still out a tick after the m-th
        a = self.alpha
        self.weight[told] = (1 - a) * self.weight[told] + a
        self.soon[told] = (1 - a) * self.soon[told] + a * soon[told]
        self.gap[told] = (1 - a) * self.gap[told] + a * gap[told]

    def pays(self, k: int, rate: float) -> bool:
        """Whether, on the record, waiting past the k-th arrival for the next gradient is worth
        more than stopping at it, at the going ``rate`` (gradients per second)."""
        if k < 1 or k > self.weight.size or self.weight[k - 1] < MIN_WEIGHT:
            return False
        w = self.weight[k - 1]
        p_soon = self.soon[k - 1] / w
        mean_gap = self.gap[k - 1] / max(self.soon[k - 1], 1e-12)
        return p_soon * (1.0 - rate * mean_gap) - (1.0 - p_soon) * rate * self.tick_s > 0

    def floor(self, n: int, rate: float, start: int = 1) -> int:
        """The first k >= ``start`` (up to n) whose next gradient does not pay for itself on the
        record: where an iteration that would stop at ``start`` stops instead."""
        k = max(start, 1)
        while k < n and self.pays(k, rate):
            k += 1
        return k
