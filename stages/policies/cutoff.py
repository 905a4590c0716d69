"""Synchronous cutoff policies: each iteration, wait for the first c of the live workers' gradients.

The dynamic ones share one objective. Given S joint samples of the next run-times over the live
workers, sort each sample; the iteration ends when the c-th gradient arrives, so its expected
length is E[x_(c)] (the mean over samples of the c-th smallest), and the policy picks

    c* = argmax_c  c / (E[x_(c)] + overhead_s)

the expected gradients per second. :func:`best_cutoff` evaluates every c at once (one sort, one
mean, one argmax); no Python loop over c or over workers. ``ecdf``, ``ewma`` and ``bdsgd`` differ
only in where the samples come from; ``elfving`` replaces the Monte Carlo order statistics by
Elfving's closed form for a Gaussian; ``oracle`` sorts the true run-times.
"""

from __future__ import annotations

import abc

import numpy as np
import torch
from scipy.special import ndtri

from stages.errors import ConfigError
from stages.policies.base import Policy, Predictor
from stages.policies.estimators import EwmaLogNormal, WindowLogNormal

QUANTILES = (0.1, 0.5, 0.9)


def best_cutoff(expected: np.ndarray, overhead_s: float) -> int:
    """c in 1..n maximizing c / (expected[c-1] + overhead_s); ``expected`` are the (n,) expected
    order statistics E[x_(1)] <= ... <= E[x_(n)]. Ties go to the larger c (as many gradients per
    second, and more of them per update)."""
    n = expected.shape[0]
    rate = np.arange(1, n + 1) / np.maximum(expected + overhead_s, 1e-12)
    return n - int(np.argmax(rate[::-1]))


def sorted_samples(samples: np.ndarray) -> np.ndarray:
    """(S, n) samples sorted along workers: column c-1 holds S draws of x_(c)."""
    return np.sort(samples, axis=1)


class FullSync(Policy):
    """``full``: wait for every live worker (c = N)."""

    def __init__(self) -> None:
        self.name = "full"

    def choose(self, live: np.ndarray) -> int:
        return max(int(live.sum()), 1)

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        """Nothing to learn."""


class StaticCutoff(Policy):
    """``static:C``: Chen et al.'s backup workers, always the first C (capped to the live ones)."""

    def __init__(self, c: int) -> None:
        if c < 1:
            raise ConfigError(f"static:C needs C >= 1, got {c}")
        self.c = c
        self.name = f"static:{c}"

    def choose(self, live: np.ndarray) -> int:
        return max(min(self.c, int(live.sum())), 1)

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        """Nothing to learn."""


class OracleCutoff(Policy):
    """``oracle`` (simulation only): the driver calls :meth:`reveal` with the true run-times of
    the coming iteration before :meth:`choose`; c* = argmax c / (x_(c) + overhead_s)."""

    def __init__(self) -> None:
        self.name = "oracle"
        self._truth: np.ndarray | None = None

    def reveal(self, runtimes: np.ndarray) -> None:
        self._truth = np.asarray(runtimes, dtype=float)

    def choose(self, live: np.ndarray) -> int:
        if self._truth is None:
            raise RuntimeError("oracle: reveal() the iteration's run-times before choose()")
        return best_cutoff(np.sort(self._truth[live]), self.overhead_s)

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self._truth = None


class ElfvingCutoff(Policy):
    """``elfving``: a Gaussian (mu, sigma) on the run-times of a recent window, pooled over
    workers, and Elfving's approximation E[x_(c)] ~ mu + sigma * PhiInv((c - pi/8)/(n - pi/4 + 1)).
    Censored values enter the window as their conditional mean (see ``estimators``)."""

    def __init__(self, window: int = 50) -> None:
        self.name = "elfving"
        self.window = WindowLogNormal(window)

    def choose(self, live: np.ndarray) -> int:
        n = int(live.sum())
        values = np.exp(self.window.values())
        if values.size < 2 or n < 1:
            return max(n, 1)
        c = np.arange(1, n + 1)
        z = ndtri((c - np.pi / 8) / (n - np.pi / 4 + 1))
        return best_cutoff(values.mean() + values.std() * z, self.overhead_s)

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.window.observe(runtimes, censored)


class MonteCarloCutoff(Policy):
    """A policy that draws S joint samples of the next run-times and applies :func:`best_cutoff`.

    Before any data it waits for everyone. :meth:`describe` gives the 10/50/90% quantiles of the
    predicted iteration time x_(c) + overhead_s for the c it chose last.
    """

    def __init__(self, num_samples: int = 256) -> None:
        if num_samples < 1:
            raise ConfigError(f"num_samples must be >= 1, got {num_samples}")
        self.num_samples = num_samples
        self._chosen: np.ndarray | None = None

    @abc.abstractmethod
    def samples(self, live: np.ndarray) -> np.ndarray | None:
        """(S, n_live) samples of the next run-times of the live workers, or None if the policy
        has nothing to go on yet."""

    def choose(self, live: np.ndarray) -> int:
        draws = self.samples(live)
        if draws is None or draws.shape[1] == 0:
            self._chosen = None
            return max(int(live.sum()), 1)
        ordered = sorted_samples(draws)
        c = best_cutoff(ordered.mean(axis=0), self.overhead_s)
        self._chosen = ordered[:, c - 1]
        return c

    def describe(self) -> dict:
        if self._chosen is None:
            return {}
        q = np.quantile(self._chosen, QUANTILES) + self.overhead_s
        return {"pred_q10": float(q[0]), "pred_q50": float(q[1]), "pred_q90": float(q[2])}


class EcdfCutoff(MonteCarloCutoff):
    """``ecdf``: resample the pooled run-times of the last ``window`` iterations (the empirical
    distribution, every worker alike)."""

    def __init__(self, window: int = 50, num_samples: int = 256, seed: int = 0) -> None:
        super().__init__(num_samples)
        self.name = "ecdf"
        self.window = WindowLogNormal(window)
        self.rng = np.random.default_rng(seed)

    def samples(self, live: np.ndarray) -> np.ndarray | None:
        values = self.window.values()
        if values.size == 0:
            return None
        idx = self.rng.integers(0, values.size, (self.num_samples, int(live.sum())))
        return np.exp(values[idx])

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.window.observe(runtimes, censored)


class EwmaCutoff(MonteCarloCutoff):
    """``ewma``: each worker's own log-normal from exponentially weighted log run-times,
    independent across workers."""

    def __init__(
        self, num_workers: int, alpha: float = 0.1, num_samples: int = 256, seed: int = 0
    ) -> None:
        super().__init__(num_samples)
        self.name = "ewma"
        self.ewma = EwmaLogNormal(num_workers, alpha=alpha)
        self.rng = np.random.default_rng(seed)

    def samples(self, live: np.ndarray) -> np.ndarray | None:
        if not self.ewma.seen.any():
            return None
        mu, sigma = self.ewma.params()
        z = self.rng.standard_normal((self.num_samples, int(live.sum())))
        return np.exp(mu[live] + sigma[live] * z)

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.ewma.observe(runtimes, censored)


class BdsgdCutoff(MonteCarloCutoff):
    """``bdsgd``: joint samples from the fitted run-time model's posterior predictive."""

    def __init__(self, predictor: Predictor, num_samples: int = 256) -> None:
        super().__init__(num_samples)
        self.name = "bdsgd"
        self.predictor = predictor

    def samples(self, live: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            draws = self.predictor.sample(self.num_samples)
        return draws.detach().cpu().numpy()[:, live]

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.predictor.observe(runtimes, censored)
