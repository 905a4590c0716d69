"""Held-out one-step-ahead predictive NLL (SPEC metric ``nll``) of the model and the baselines.

Every run is filtered from its first iteration; only iterations ``t >= split(T)`` (the last
``holdout`` share, never trained on) are scored, each by its predictive given ``x_{<t}``. The NLL
is the summed negative log-likelihood in nats of seconds (censored entries: log survival) divided
by the number of scored entries, pooled over runs.

- ``model``: the joint predictive of :meth:`RuntimePredictor.log_predictive` (Monte Carlo over
  latent states of the joint likelihood over workers).
- ``window``: :class:`WindowLogNormal`, one log-normal pooled over the last window.
- ``ewma``: :class:`EwmaLogNormal`, a log-normal per worker.
Both baselines are the estimators the policies of the same name use, with their defaults.

Calibration (:class:`PitCollector`): on the same held-out iterations, the share of exact
run-times, and of the order statistic x_(c) at the c a cutoff policy would pick, inside their
central 90% predictive interval, with the histogram of their PIT values. A well-fitted NLL can
hide a tail that is too light or too heavy exactly where the policy cuts; coverage cannot.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
from bdsgd.stages.estimators import EwmaLogNormal, WindowLogNormal, lognormal_logpdf_or_logsf
from bdsgd.stages.model.checkpoint import Checkpoint
from bdsgd.stages.model.online import order_statistic_at_cut
from bdsgd.stages.model.predictor import predictor_from
from bdsgd.stages.store import RunMatrix
from scipy.special import smirnov, smirnovi


@dataclass(frozen=True)
class NllReport:
    """Held-out NLL per run-time (nats) of the model and the baselines, and the entries scored."""

    model: float
    window: float
    ewma: float
    entries: int
    calibration: dict | None = None
    """The model's :meth:`PitCollector.summary` on the same held-out iterations."""


def split(iterations: int, holdout: float) -> int:
    """First held-out iteration: the last ``holdout`` share (at least one iteration) is held out."""
    return min(iterations - 1, max(1, int(round(iterations * (1.0 - holdout)))))


def _observed(run: RunMatrix, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run-times with missing entries as NaN, censoring flags and the presence mask at t."""
    present = run.present[t] & np.isfinite(run.runtimes[t])
    return np.where(present, run.runtimes[t], np.nan), run.censored[t] & present, present


class Filtered:
    """Predictors filtered through the first iterations of runs, kept for whoever filters the
    same run again from its first iteration with the same model and seed: ``fit``'s
    recalibration and its held-out evaluation both filter every run up to the held-out start
    (1,600 ``observe`` calls a run at 32 x 2,000). Each use gets its own copy (the model is
    shared, not copied); a checkpoint's ``common`` only changes the draws, and the online
    spread never changes the filter, so both are set on the copy."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int, int, int], tuple] = {}

    def at(self, ckpt: Checkpoint, run: RunMatrix, upto: int, seed: int, online: bool = True):
        """A predictor of ``ckpt`` for ``run`` that has observed iterations 0 .. upto - 1."""
        key = (id(ckpt.model), id(run), upto, seed)
        if key not in self._kept:  # (the model and the run are kept: their ids stay theirs)
            predictor = _fresh(ckpt, run, seed)
            for t in range(upto):
                x, cens, _ = _observed(run, t)
                predictor.observe(x, cens)
            self._kept[key] = (predictor, ckpt.model, run)
        kept = self._kept[key][0]
        predictor = copy.deepcopy(kept, memo={id(kept.model): kept.model})
        predictor.common = (*ckpt.common, 1.0)[:4]
        if not online:
            predictor.online = None
        return predictor


def _fresh(ckpt: Checkpoint, run: RunMatrix, seed: int):
    return predictor_from(ckpt, list(range(run.shape[1])), list(run.hosts), seed=seed)


def start_at(ckpt, run, start: int, seed: int, filtered: Filtered | None, online: bool = True):
    """(predictor, first iteration to go on from): one filtered through ``start`` iterations
    (``filtered``), or a fresh one at iteration 0."""
    if filtered is None:
        predictor = _fresh(ckpt, run, seed)
        if not online:
            predictor.online = None
        return predictor, 0
    return filtered.at(ckpt, run, start, seed, online), start


def baseline_log_lik(run: RunMatrix, start: int) -> tuple[float, float]:
    """Summed held-out log-likelihood of the ``window`` and ``ewma`` baselines on one run."""
    window, ewma = WindowLogNormal(), EwmaLogNormal(run.shape[1])
    totals = np.zeros(2)
    for t in range(run.shape[0]):
        x, cens, present = _observed(run, t)
        if t >= start and present.any():
            mu_w, sigma_w = window.pooled()
            mu_e, sigma_e = ewma.params()
            for i, (mu, sigma) in enumerate(((mu_w, sigma_w), (mu_e, sigma_e))):
                ll = lognormal_logpdf_or_logsf(x[present], cens[present], *_at(mu, sigma, present))
                totals[i] += ll.sum()
        window.observe(x, cens)
        ewma.observe(x, cens)
    return float(totals[0]), float(totals[1])


def _at(mu, sigma, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Broadcast scalar or per-worker (mu, sigma) to the present entries."""
    mu = np.broadcast_to(np.asarray(mu, dtype=float), present.shape)[present]
    sigma = np.broadcast_to(np.asarray(sigma, dtype=float), present.shape)[present]
    return mu, sigma


def model_log_lik(
    ckpt: Checkpoint,
    run: RunMatrix,
    start: int,
    samples: int,
    seed: int,
    pits: PitCollector | None = None,
    pits_from: int = 0,
    filtered: Filtered | None = None,
) -> float:
    """Summed held-out joint one-step-ahead log-likelihood of the model on one run; with
    ``pits``, also the PIT values of each held-out iteration from ``pits_from`` on
    (:class:`PitCollector`)."""
    predictor, first = start_at(ckpt, run, start, seed, filtered)
    total = 0.0
    for t in range(first, run.shape[0]):
        x, cens, present = _observed(run, t)
        if t >= start and present.any():
            total += predictor.log_predictive(x, cens, samples)[0]
            if pits is not None:  # drawn at every held-out iteration, as a policy draws
                draws = predictor.sample(samples).numpy()
                if t >= pits_from:
                    pits.add(draws, x, cens, present)
        predictor.observe(x, cens)
    return total


def evaluate(
    ckpt: Checkpoint,
    runs: list[RunMatrix],
    holdout: float,
    samples: int = 256,
    seed: int = 0,
    calibration_skip: float = 0.0,
    filtered: Filtered | None = None,
) -> NllReport:
    """Held-out NLL of the model and both baselines over ``runs``, and the model's calibration
    on the held-out iterations after the first ``calibration_skip`` share of them (those the
    recalibration measured on; see the module docstring)."""
    totals, entries = np.zeros(3), 0
    pits = PitCollector()
    for run in runs:
        start = split(run.shape[0], holdout)
        entries += int((run.present[start:] & np.isfinite(run.runtimes[start:])).sum())
        pits_from = start + int(calibration_skip * (run.shape[0] - start))
        model = model_log_lik(ckpt, run, start, samples, seed, pits, pits_from, filtered)
        totals += (model, *baseline_log_lik(run, start))
    nll = -totals / max(entries, 1)
    return NllReport(float(nll[0]), float(nll[1]), float(nll[2]), entries, pits.summary())


CENTRAL = 0.9  # the central predictive interval whose coverage is reported
PIT_BINS = 10


class PitCollector:
    """Probability integral transforms of held-out values under the model's joint predictive
    (S samples of the iteration, drawn before it):

    - every run-time seen exactly: u = share of its worker's samples below it;
    - the order statistic x_(c) at the c a cutoff policy would choose from the same samples
      (the best c / E[x_(c)]), where the iteration shows it exactly (at least c exact values,
      none of them above a censoring bound): u = share of the samples' c-th smallest below it.

    A calibrated predictive gives uniform u: a central 90% interval holds 90% of the values.
    ``c``: x_(c) at this c instead (the draws and values may then be any increasing function of
    the run-times, logs say: only their order counts)."""

    def __init__(self, c: int | None = None) -> None:
        self.c = c
        self.runtime: list[np.ndarray] = []
        self.order: list[float] = []
        self.cutoffs: list[int] = []

    def add(self, draws: np.ndarray, x: np.ndarray, cens: np.ndarray, present: np.ndarray):
        """One held-out iteration: (S, N) predictive draws, (N,) values, censoring, presence."""
        exact = present & ~cens
        self.runtime.append((draws[:, exact] < x[exact]).mean(axis=0))
        cut = order_statistic_at_cut(draws, x, cens, present, self.c)
        if cut is not None:
            c, predicted, seen = cut
            self.order.append(float((predicted < seen).mean()))
            self.cutoffs.append(c)

    def values(self) -> tuple[np.ndarray, np.ndarray]:
        """The PIT values held: of the run-times (every iteration's, in one array) and of x_(c)."""
        runtime = np.concatenate(self.runtime) if self.runtime else np.zeros(0)
        return runtime, np.asarray(self.order)

    def summary(self) -> dict:
        """Coverage of the central 90% interval, the PIT histogram (10 equal bins, shares) and
        the largest gap between the PITs' distribution and the uniform, for run-times and for
        x_(c); the number of values behind each."""
        runtime, order = self.values()
        out = {"central": CENTRAL}
        for name, u in (("runtime", runtime), ("order_stat", order)):
            out[name] = pit_summary(u)
        out["order_stat"]["mean_c"] = float(np.mean(self.cutoffs)) if self.cutoffs else None
        return out


def pit_summary(u: np.ndarray) -> dict:
    """coverage, histogram, ks and count of PIT values ``u``; with them ``ks_p95``, the KS
    distance a calibrated predictive stays under in 95% of samples of ``count`` values, and
    ``ks_p``, the chance a calibrated one gives ``ks`` or more: a calibrated predictive's KS
    over n values averages 0.87 / sqrt(n) (0.056 over 240, 0.05 over 300), so whether a KS
    shows miscalibration depends on n (docs/benchmarks.md, issue 31).

    Both from the one-sided statistic's exact distribution (``scipy.special.smirnov``; not
    ``scipy.stats.kstwo``, whose import costs a fit most of a second): the two-sided
    ``ks_p95`` is the one-sided 97.5% point (within 3e-7 of kstwo's for every n), and ``ks_p``
    twice the one-sided chance, capped at 1: an upper bound on the two-sided chance, within
    0.001 of it wherever that is below 0.3."""
    if u.size == 0:
        return {"coverage": None, "histogram": None, "ks": None, "count": 0, "ks_p95": None,
                "ks_p": None}  # fmt: skip
    tail = (1.0 - CENTRAL) / 2
    hist = np.histogram(u, bins=PIT_BINS, range=(0.0, 1.0))[0] / u.size
    ks = ks_distance(u)
    return {
        "coverage": float(np.mean((u >= tail) & (u <= 1.0 - tail))),
        "histogram": [round(float(h), 4) for h in hist],
        "ks": ks,
        "count": int(u.size),
        "ks_p95": float(smirnovi(u.size, 0.025)),
        "ks_p": min(1.0, 2.0 * float(smirnov(u.size, ks))),
    }


def ks_distance(u: np.ndarray) -> float:
    """Kolmogorov-Smirnov distance of ``u``'s empirical distribution from the uniform on
    [0, 1]: the largest gap on either side of each step."""
    ordered = np.sort(u)
    n = ordered.size
    above = np.arange(1, n + 1) / n - ordered
    below = ordered - np.arange(n) / n
    return float(max(above.max(), below.max()))
