"""Online calibration of the order statistic a cutoff policy waits for.

The recalibration of ``fit`` (:mod:`bdsgd.stages.model.recalibrate`) is measured once, on the first
half of the held-out part. Where the cluster then changes, it no longer holds: on the benchmark
clusters the x_(c) of the second half were covered 83% (``syn1``, whose second half had more slow
spells than its first) and 98% (``load``, whose first half still held the filter's catching up
with a new load level, its second half not) by central 90% intervals set to cover 90% of the
first half's.

:class:`OnlineSpread` keeps adjusting the spread of x_(c)'s predictive from the iterations the
predictor has seen, by adaptive conformal inference (Gibbs and Candes, NeurIPS 2021): after each
iteration whose x_(c) is shown (the c a cutoff policy would pick from the draws, as in
:func:`order_statistic_at_cut`), the log of a factor on the spread of the draws' shared level
moves up by ``STEP * 0.9`` if x_(c) fell outside the draws' central 90% interval and down by
``STEP * 0.1`` if inside. Over any stretch of iterations the share outside is then 10%, up to
(the range of the log factor + ``STEP``) / (``STEP`` x the iterations), whatever the cluster does.
The factor stretches the draws :meth:`bdsgd.stages.model.predictor.RuntimePredictor.sample` returns;
the joint log-likelihood (``val_nll``) and the draws conditioned on arrivals (``remaining``) are
the model's without it.

It also moves the draws' level: after the same iteration the log of a shift on every draw moves
by a step times the spread of the draws' log x_(c), times 2u - 1, where u is x_(c)'s PIT (the
share of the drawn x_(c) below it). A stochastic approximation of the level at which x_(c)'s
mean PIT is 1/2: x_(c) that keeps falling on one side of the draws moves them there; a calibrated
one leaves the shift wandering about zero with a sd of about a sixth of the spread (2-3% more
variance in x_(c)'s error). On the held-out runs at a level
no fit saw, the model's filter still carried the run's slow start into the iterations after it
(the draws' level 1-2% slow for iterations 3-10, where x_(c)'s spread is about 1.5%); the shift
takes that out (docs/benchmarks.md, issue 31).

The step is ``LEVEL_STEP + LEVEL_BOOST * LEVEL_DECAY^k`` at the shift's k-th move (k = 0 first):
0.4 at the first, 0.2 by the 11th, within 0.01 of ``LEVEL_STEP`` from the 34th on. A new state
knows nothing of the run's offset, and what the filter carries of a run's start fades as its
slow EWMA forgets it (weight ``0.9^t``, :data:`bdsgd.stages.model.data.ALPHA_SLOW`), so the
step decays at that rate to the constant one, which tracks a cluster that drifts. With the
constant step alone, one fit of the level clusters (seed 2) left x_(c) too slow at iterations
3-9 (its mean PIT over the 24 replayed runs 0.11-0.42) and its KS after the runs' first
iteration at 0.061; with the decaying one, 0.038 (docs/benchmarks.md, "The online shift's step
fades from a run's start").
"""

from __future__ import annotations

import math

import numpy as np
from bdsgd.stages.model.data import ALPHA_SLOW

TAIL = 0.05  # the central 90% interval: x_(c) below its 5% or above its 95% point is a miss
STEP = 0.2  # the move of the log factor per iteration (up 0.18 on a miss, down 0.02 otherwise)
LOG_LIMITS = (-2.0, 1.0)  # the factor stays within exp(-2) .. exp(1)
LEVEL_STEP = 0.1  # the shift's move per iteration, in units of the spread of log x_(c)'s draws
LEVEL_BOOST = 0.3  # added to it at the shift's first move, fading by LEVEL_DECAY a move
LEVEL_DECAY = 1.0 - ALPHA_SLOW  # as the slow EWMA forgets the run's start
SHIFT_LIMIT = 0.5  # the shift stays within exp(-0.5) .. exp(0.5)


class OnlineSpread:
    """The online factor on the spread of each joint draw's shared level and the online shift of
    every draw (see the module docstring): :meth:`drawn` is told the draws before the iteration,
    :meth:`update` what it showed."""

    def __init__(
        self, step: float = STEP, level_step: float = LEVEL_STEP, level_boost: float = LEVEL_BOOST
    ) -> None:
        self.step, self.level_step, self.level_boost = step, level_step, level_boost
        self.log_factor = 0.0
        self.log_shift = 0.0  # added to the log of every draw
        self.moves = 0  # how often the shift has moved: its next step's k
        self.draws: np.ndarray | None = None

    @property
    def shift_step(self) -> float:
        """The shift's next step, in units of the spread of log x_(c)'s draws."""
        return self.level_step + self.level_boost * LEVEL_DECAY**self.moves

    @property
    def factor(self) -> float:
        return math.exp(self.log_factor)

    def drawn(self, draws: np.ndarray) -> None:
        """(S, N) predictive draws, seconds, of the coming iteration."""
        self.draws = draws

    def update(self, x: np.ndarray, cens: np.ndarray) -> bool | None:
        """The iteration drawn for showed (N,) run-times ``x`` (non-finite or non-positive:
        missing) with censoring flags ``cens``; whether its x_(c) was a miss (None: not shown,
        or no draws: no move)."""
        draws, self.draws = self.draws, None
        if draws is None:
            return None
        present = np.isfinite(x) & (x > 0)
        cut = order_statistic_at_cut(draws, x, np.asarray(cens, dtype=bool) & present, present)
        if cut is None:
            return None
        u = float((cut[1] < cut[2]).mean())
        miss = u < TAIL or u > 1.0 - TAIL
        moved = self.log_factor + self.step * (float(miss) - 2 * TAIL)
        self.log_factor = float(np.clip(moved, *LOG_LIMITS))
        spread = float(np.log(cut[1]).std())
        shifted = self.log_shift + self.shift_step * spread * (2.0 * u - 1.0)
        self.log_shift = float(np.clip(shifted, -SHIFT_LIMIT, SHIFT_LIMIT))
        self.moves += 1
        return miss


def order_statistic_at_cut(
    draws: np.ndarray, x: np.ndarray, cens: np.ndarray, present: np.ndarray, c: int | None = None
) -> tuple[int, np.ndarray, float] | None:
    """The c a cutoff policy would pick from (S, N) predictive ``draws`` of the present workers
    (the best c / E[x_(c)]; or the given ``c``), the S predicted draws of x_(c), and x_(c) as the
    iteration showed it; None where it did not show it exactly (fewer than c exact values below
    every censoring bound) or nobody was present."""
    live = draws[:, present]
    if live.shape[1] == 0:
        return None
    ordered = np.sort(live, axis=1)
    if c is None:
        c = int(np.argmax(np.arange(1, live.shape[1] + 1) / ordered.mean(axis=0))) + 1
    seen = np.sort(x[present & ~cens])
    bound = x[present & cens].min(initial=np.inf)
    if seen.size < c or seen[c - 1] > bound:
        return None
    return c, ordered[:, c - 1], float(seen[c - 1])
