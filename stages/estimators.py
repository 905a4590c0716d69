"""Simple per-worker run-time estimators, shared by the ``window``/``ewma`` NLL baselines of fit
and the ``elfving``/``ecdf``/``ewma`` policies, so "the baseline" means one thing everywhere.

Both work on log run-times. A censored value tau (real run-time >= tau) is not taken at face value:
the EWMA replaces it by the conditional mean E[log x | log x >= log tau] under its current
log-normal (the truncated-normal mean), and ignores it when tau is below that mean minus one
spread, where it says almost nothing. The window keeps the last W iterations' log values, censored
ones replaced in the same way, and pools them over workers.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

LOG_SQRT_2PI = 0.5 * np.log(2 * np.pi)


def log_ndtr(x: np.ndarray) -> np.ndarray:
    """log Phi(x), stable in both tails."""
    return torch.special.log_ndtr(torch.as_tensor(x, dtype=torch.float64)).numpy()


def lognormal_logpdf_or_logsf(
    x: np.ndarray, censored: np.ndarray, mu: np.ndarray, sigma: np.ndarray
) -> np.ndarray:
    """Per-entry log-likelihood: log density of a log-normal(mu, sigma) at x, or for censored
    entries the log survival log P(X >= x)."""
    logx = np.log(x)
    z = (logx - mu) / sigma
    logpdf = -0.5 * z**2 - np.log(sigma) - LOG_SQRT_2PI - logx
    return np.where(censored, log_ndtr(-z), logpdf)


def censored_log_mean(logtau: np.ndarray, mu: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """E[log x | log x >= log tau] for log x ~ N(mu, sigma^2): mu + sigma * phi(a) / (1 - Phi(a))."""
    a = (logtau - mu) / sigma
    log_phi = -0.5 * a**2 - LOG_SQRT_2PI
    return mu + sigma * np.exp(log_phi - log_ndtr(-a))


class EwmaLogNormal:
    """Per-worker exponentially weighted mean and variance of log run-time."""

    def __init__(self, num_workers: int, alpha: float = 0.1, init_sigma: float = 0.5):
        self.alpha = alpha
        self.init_sigma = init_sigma
        self.mu = np.zeros(num_workers)
        self.var = np.full(num_workers, init_sigma**2)
        self.seen = np.zeros(num_workers, dtype=bool)

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        logx = np.log(np.asarray(runtimes, dtype=float))
        censored = np.asarray(censored, dtype=bool)
        first = ~self.seen & ~censored & np.isfinite(logx)
        self.mu[first] = logx[first]
        self.seen |= first
        sigma = np.sqrt(self.var)
        target = np.where(censored, censored_log_mean(logx, self.mu, sigma), logx)
        use = self.seen & ~first & np.isfinite(logx) & (~censored | (logx > self.mu - sigma))
        diff = target - self.mu
        self.mu = np.where(use, self.mu + self.alpha * diff, self.mu)
        self.var = np.where(use, (1 - self.alpha) * (self.var + self.alpha * diff**2), self.var)
        self.var = np.maximum(self.var, 1e-6)

    def params(self) -> tuple[np.ndarray, np.ndarray]:
        """(mu, sigma) of each worker's log-normal; workers never seen get the pooled mean."""
        mu = self.mu.copy()
        if self.seen.any() and not self.seen.all():
            mu[~self.seen] = self.mu[self.seen].mean()
        return mu, np.sqrt(self.var)


class WindowLogNormal:
    """One log-normal pooled over all workers' last ``window`` iterations."""

    def __init__(self, window: int = 50):
        self.logs: deque[np.ndarray] = deque(maxlen=window)

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        logx = np.log(np.asarray(runtimes, dtype=float))
        censored = np.asarray(censored, dtype=bool)
        ok = np.isfinite(logx)
        if self.logs:
            mu, sigma = self.pooled()
            logx = np.where(censored, censored_log_mean(logx, mu, sigma), logx)
        self.logs.append(logx[ok])

    def values(self) -> np.ndarray:
        """The window's log run-times, flattened."""
        return np.concatenate(list(self.logs)) if self.logs else np.zeros(0)

    def pooled(self) -> tuple[float, float]:
        v = self.values()
        if v.size < 2:
            return (float(v.mean()) if v.size else 0.0), 0.5
        return float(v.mean()), max(float(v.std()), 1e-3)
