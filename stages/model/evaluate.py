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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stages.model.checkpoint import Checkpoint
from stages.model.predictor import predictor_from
from stages.policies.estimators import EwmaLogNormal, WindowLogNormal, lognormal_logpdf_or_logsf
from stages.store import RunMatrix


@dataclass(frozen=True)
class NllReport:
    """Held-out NLL per run-time (nats) of the model and the baselines, and the entries scored."""

    model: float
    window: float
    ewma: float
    entries: int


def split(iterations: int, holdout: float) -> int:
    """First held-out iteration: the last ``holdout`` share (at least one iteration) is held out."""
    return min(iterations - 1, max(1, int(round(iterations * (1.0 - holdout)))))


def _observed(run: RunMatrix, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run-times with missing entries as NaN, censoring flags and the presence mask at t."""
    present = run.present[t] & np.isfinite(run.runtimes[t])
    return np.where(present, run.runtimes[t], np.nan), run.censored[t] & present, present


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


def model_log_lik(ckpt: Checkpoint, run: RunMatrix, start: int, samples: int, seed: int) -> float:
    """Summed held-out joint one-step-ahead log-likelihood of the model on one run."""
    predictor = predictor_from(ckpt, list(range(run.shape[1])), list(run.hosts), seed=seed)
    total = 0.0
    for t in range(run.shape[0]):
        x, cens, present = _observed(run, t)
        if t >= start and present.any():
            total += predictor.log_predictive(x, cens, samples)[0]
        predictor.observe(x, cens)
    return total


def evaluate(
    ckpt: Checkpoint, runs: list[RunMatrix], holdout: float, samples: int = 256, seed: int = 0
) -> NllReport:
    """Held-out NLL of the model and both baselines over ``runs`` (see the module docstring)."""
    totals, entries = np.zeros(3), 0
    for run in runs:
        start = split(run.shape[0], holdout)
        entries += int((run.present[start:] & np.isfinite(run.runtimes[start:])).sum())
        totals += (model_log_lik(ckpt, run, start, samples, seed), *baseline_log_lik(run, start))
    nll = -totals / max(entries, 1)
    return NllReport(float(nll[0]), float(nll[1]), float(nll[2]), entries)
