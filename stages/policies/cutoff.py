"""Synchronous cutoff policies: each iteration, wait for the first c of the live workers' gradients.

The dynamic ones share one objective. Given S joint samples of the next run-times over the live
workers, sort each sample; the iteration ends when the c-th gradient arrives, so its expected
length is E[x_(c)] (the mean over samples of the c-th smallest).

Throughput is a ratio of sums, sum(c_t) / sum(x_(c_t) + overhead_s), so the c that maximises
the long run is not the one that maximises each iteration's own ratio. By the renewal-reward
argument (Dinkelbach's method for ratio objectives) the long-run optimum picks, every iteration,

    c* = argmax_c  c - lambda * (E[x_(c)] + overhead_s)            (``long-run``, the default)

where lambda is the throughput the policy achieves: each gradient must pay for the seconds it
costs at the going rate. When the whole cluster is slow this waits for fewer gradients, when it
is fast, for more. lambda is a slowly moving average of the achieved gradients and seconds
(:class:`RateTracker`) over the iterations whose c this policy chose (a warm-up on history recorded
under another policy, e.g. a full-sync profile, teaches the predictor but not lambda), so it
follows a drifting cluster. It is capped by the recent mean of the best per-iteration rate the
predictive offers (:meth:`MonteCarloCutoff.going_rate`), which stops a censoring spiral. Before the policy has chosen any c, and with ``objective="iteration"``,
it picks the per-iteration rate

    c* = argmax_c  c / (E[x_(c)] + overhead_s)

:func:`best_cutoff` evaluates every c at once (one sort, one mean, one argmax); no Python loop
over c or over workers. ``ecdf``, ``ewma`` and ``bdsgd`` differ only in where the samples come
from; ``elfving`` (the paper's baseline) replaces the Monte Carlo order statistics by Elfving's
closed form for a Gaussian and keeps the per-iteration rate; ``oracle`` sorts the true run-times.

Goodput (``:goodput``, for ``elfving``, ``ecdf``, ``ewma`` and ``bdsgd``): c gradients are worth
gain(c) one-worker steps, not c (``bdsgd.stages.goodput``: at most c, close to c while gradient noise
dominates, close to 1 when gradients agree), at the noise scale the driver pushes with
``set_noise_scale``. Every c above becomes gain(c), lambda included (the goodput achieved), in
:meth:`MonteCarloCutoff.choose` and :meth:`MonteCarloCutoff.revise` alike. c = 1 is ruled out
while two workers live: one gradient measures no noise, and a c stuck at 1 would never see the
noise scale change.

Salvage (``salvage_parts`` >= 2: a training loop adds the micro-batches a cut rank finished to
the average, its default): an iteration cut at the c-th arrival applies c whole gradients and,
of each worker j still out, the micro-batches it finished, the one it is in included: it finishes
that one before it sees the cut, so the iteration ends when the last of them does
(:func:`cut_terms`). What c is worth is then c plus the expected salvaged share, and it lasts
until that end, in choose, revise and lambda alike: a cut costs the samples the cut workers had
not done, and saves only the time to their next micro-batch's end. A worker about to finish is
not worth cutting; a persistently slow one, early in its batch, is.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import numpy as np
import torch
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.estimators import EwmaLogNormal, WindowLogNormal
from bdsgd.stages.goodput import gain
from bdsgd.stages.policies.base import Policy, Predictor
from bdsgd.stages.policies.floor import SMALL_N, ArrivalRecord
from bdsgd.stages.policy_names import OBJECTIVES, STOPPING
from scipy.special import log_ndtr, ndtri, ndtri_exp

QUANTILES = (0.1, 0.5, 0.9)


LOOKBACK = 12  # online: arrivals before the chosen c from which revise() weighs stopping
MIN_MEASURED = 2  # :goodput: the fewest gradients that still measure the noise scale


def best_cutoff(
    expected: np.ndarray,
    overhead_s: float,
    rate: float | None = None,
    worth: np.ndarray | None = None,
) -> int:
    """c in 1..n maximizing c / (expected[c-1] + overhead_s), or, given the going ``rate``
    (gradients per second), c - rate * (expected[c-1] + overhead_s); ``expected`` are the (n,)
    expected order statistics E[x_(1)] <= ... <= E[x_(n)]. ``worth`` (n,) replaces c by what c
    gradients are worth (``:goodput``: gain(c), and ``rate`` is then the goodput). Ties go to
    the larger c (more gradients per update)."""
    n = expected.shape[0]
    if rate is not None and rate > 0:
        value = _worth_of(n, worth) - rate * (expected + overhead_s)
    else:
        value = iteration_rates(expected, overhead_s, worth)
    return n - int(np.argmax(value[::-1]))


def iteration_rates(
    expected: np.ndarray, overhead_s: float, worth: np.ndarray | None = None
) -> np.ndarray:
    """(n,) gradients per second of an iteration that waits for c = 1..n: c / (E[x_(c)] + o)
    (``worth[c-1]`` in place of c when given)."""
    return _worth_of(expected.shape[0], worth) / np.maximum(expected + overhead_s, 1e-12)


def _worth_of(n: int, worth: np.ndarray | None) -> np.ndarray:
    return np.arange(1, n + 1, dtype=float) if worth is None else worth


def long_run_value(worth, seconds, rate: float | None):
    """What ``worth`` gradients in ``seconds`` are worth at the going ``rate``:
    worth - rate * seconds (the long-run objective)."""
    return worth - rate * seconds


def iteration_value(worth, seconds, rate: float | None = None):
    """The per-iteration rate worth / seconds (``rate`` unused)."""
    return worth / np.maximum(seconds, 1e-12)


MAX_PAIRS = 16_384  # cut_terms: samples x n x n entries at most (fewer samples at large n, >= 16)


def cut_terms(ordered: np.ndarray, parts: int, now: float | None = None):
    """What cutting an iteration salvages and how long it then lasts, from (S, n) sorted
    samples of the workers' run-times, each spread evenly over its ``parts`` micro-batches: a
    worker cut at tau finishes the micro-batch it is in (tau < x: ceil(parts tau / x) of them),
    which adds that share of a gradient and ends at that share of x. Returns ``(extra,
    length)``: for c = 1..n (cut at the c-th arrival, every later one cut), the mean salvaged
    share and the mean end of the iteration, max(x_(c), the cut workers' ends), each (n,); with
    ``now``, the same two numbers for a cut at ``now`` before any of them arrives."""
    if now is not None:
        done = np.minimum(np.ceil(parts * now / np.maximum(ordered, 1e-12) - 1e-9), parts)
        share = done / parts
        end = np.maximum((share * ordered).max(axis=1), now)
        return float(share.sum(axis=1).mean()), float(end.mean())
    s, n = ordered.shape
    ordered = ordered[: max(16, MAX_PAIRS // max(n * n, 1))]
    tau, x = ordered[:, :, None], np.maximum(ordered[:, None, :], 1e-12)
    after = np.arange(n)[None, :] > np.arange(n)[:, None]  # (c, j): j is cut at the c-th arrival
    share = np.where(after, np.minimum(np.ceil(parts * tau / x - 1e-9), parts) / parts, 0.0)
    end = np.maximum((share * x).max(axis=2), ordered)
    return share.sum(axis=2).mean(axis=0), end.mean(axis=0)


def goodput_worth(policy: Policy, n: int) -> np.ndarray:
    """(n,) what waiting for c = 1..n gradients is worth to a ``:goodput`` policy: gain(c) at
    the noise scale the driver last set (c while it is unknown), with c = 1 ruled out (-inf)
    when n >= ``MIN_MEASURED`` (see the module's docstring)."""
    worth = np.array(gain(np.arange(1, n + 1), policy.noise_scale, policy.batch_size), ndmin=1)
    if n >= MIN_MEASURED:
        worth[: MIN_MEASURED - 1] = -np.inf
    return worth


class RateTracker:
    """lambda: the gradients per second a policy has been achieving, as the ratio of exponentially
    weighted sums of gradients and of seconds per iteration (``alpha`` 0.01: about the last 100
    iterations; bias-corrected, so the first iterations count fully)."""

    def __init__(self, alpha: float = 0.01) -> None:
        self.alpha = alpha
        self.gradients = 0.0
        self.seconds = 0.0

    def update(self, gradients: int, seconds: float) -> None:
        a = self.alpha
        self.gradients = (1 - a) * self.gradients + a * gradients
        self.seconds = (1 - a) * self.seconds + a * seconds

    def rate(self) -> float | None:
        return self.gradients / self.seconds if self.seconds > 0 else None

    def observe(
        self,
        runtimes: np.ndarray,
        censored: np.ndarray,
        overhead_s: float,
        worth: Callable[[int], float] | None = None,
    ) -> None:
        """One iteration as the server saw it: the accepted gradients (``worth`` of their count,
        e.g. gain(c) for goodput), and the iteration's length (the last accepted run-time plus
        the fixed cost)."""
        done = ~np.asarray(censored, dtype=bool)
        if done.any():
            gradients = int(done.sum())
            value = gradients if worth is None else worth(gradients)
            self.update(value, float(np.max(runtimes[done])) + overhead_s)


def sorted_samples(samples: np.ndarray) -> np.ndarray:
    """(S, n) samples sorted along workers: column c-1 holds S draws of x_(c)."""
    return np.sort(samples, axis=1)


class FullSync(Policy):
    """``full``: wait for every live worker (c = N)."""

    def __init__(self) -> None:
        self.name = "full"
        self.adaptive = False

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
        self.adaptive = False

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
    Censored values enter the window as their conditional mean (see ``estimators``).
    ``goodput``: maximise gain(c) / E[x_(c)] instead (``elfving:goodput``)."""

    def __init__(self, window: int = 50, goodput: bool = False) -> None:
        self.name = "elfving:goodput" if goodput else "elfving"
        self.window = WindowLogNormal(window)
        self.goodput = goodput

    def choose(self, live: np.ndarray) -> int:
        n = int(live.sum())
        values = np.exp(self.window.values())
        if values.size < 2 or n < 1:
            return max(n, 1)
        c = np.arange(1, n + 1)
        z = ndtri((c - np.pi / 8) / (n - np.pi / 4 + 1))
        worth = goodput_worth(self, n) if self.goodput else None
        return best_cutoff(values.mean() + values.std() * z, self.overhead_s, worth=worth)

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.window.observe(runtimes, censored)


class MonteCarloCutoff(Policy):
    """A policy that draws S joint samples of the next run-times and applies :func:`best_cutoff`.

    Before any data it waits for everyone. ``objective`` is ``long-run`` (the default) or
    ``iteration`` (see the module's docstring); ``goodput`` values c gradients at gain(c).
    Subclasses implement :meth:`samples` and :meth:`learn`. :meth:`describe` gives the 10/50/90% quantiles of the iteration time
    x_(c) + overhead_s predicted before the last iteration, for the c it ended with.
    """

    def __init__(
        self,
        num_samples: int = 256,
        objective: str = "long-run",
        stopping: str = "fixed",
        goodput: bool = False,
    ) -> None:
        if num_samples < 1:
            raise ConfigError(f"num_samples must be >= 1, got {num_samples}")
        if objective not in OBJECTIVES:
            raise ConfigError(
                f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}"
            )
        if stopping not in STOPPING:
            raise ConfigError(f"stopping must be one of {', '.join(STOPPING)}, got {stopping!r}")
        self.num_samples = num_samples
        self.objective = objective
        self.stopping = stopping
        self.online = stopping == "online"
        self.goodput = goodput
        self.tracker = RateTracker()
        self.offered = RateTracker(alpha=0.02)
        self._described: int | None = None  # the c describe() reports on
        self._decided = False
        self._c: int | None = None  # this iteration's c (choose), its live mask and lambda
        self._live: np.ndarray | None = None
        self._rate: float | None = None
        self._worth: np.ndarray | None = None  # c = 1..n live, worth (salvage, :goodput), or None
        self._salvage: np.ndarray | None = None  # c = 1..n: the share the cut ones salvage
        self._ordered: np.ndarray | None = None  # (S, n) sorted samples behind the choice

    @abc.abstractmethod
    def samples(self, live: np.ndarray) -> np.ndarray | None:
        """(S, n_live) samples of the next run-times of the live workers, or None if the policy
        has nothing to go on yet."""

    def choose(self, live: np.ndarray) -> int:
        self._decided = True
        draws = self.samples(live)
        if draws is None or draws.shape[1] == 0:
            self._live = self._ordered = self._described = None  # nothing to revise from either
            self._c = max(int(live.sum()), 1)
            return self._c
        ordered = sorted_samples(draws)
        expected = ordered.mean(axis=0)
        length = expected  # when the iteration ends if cut at the c-th arrival
        self._salvage = None
        if self.salvages:
            self._salvage, length = cut_terms(ordered, self.salvage_parts)
        self._worth = self.worth_of(np.arange(1, expected.size + 1), self._salvage, expected.size)
        rate = self.going_rate(length) if self.objective == "long-run" else None
        c = best_cutoff(length, self.overhead_s, rate, self._worth)
        self._ordered, self._described = ordered, c
        self._c, self._live, self._rate = c, np.asarray(live, dtype=bool).copy(), rate
        return c

    def predicted_for(self, c: int) -> None:
        """Make :meth:`describe` report the predicted time of the c-th arrival for the c the
        iteration ended with (an online policy may have revised the chosen one), from the same
        samples drawn before the iteration."""
        if self._ordered is not None and 1 <= c <= self._ordered.shape[1]:
            self._described = c

    def revise(self, now_s: float, runtimes: np.ndarray, arrived: np.ndarray) -> int:
        """Online stopping: at the k-th arrival (from ``LOOKBACK`` before the chosen c on),
        draw the waiting workers' run-times given what arrived and that the rest are still out
        at ``now_s`` (:meth:`conditional`), and stop now unless waiting for some later arrival j
        is worth more by the same objective as :meth:`choose`: stop if

            k - lambda (now + o)  >=  max_j  j - lambda (E[x_(j) | seen] + o)

        (``iteration`` objective: k / (now + o) against j / (E[x_(j) | seen] + o)). Otherwise
        returns the best j, and is asked again at the next arrival."""
        k = int(np.count_nonzero(arrived))
        if self._c is None or self._live is None:  # not chosen by this policy, or blind
            return self._c if self._c is not None else np.iinfo(np.int32).max
        waiting = self._live & ~np.asarray(arrived, dtype=bool)
        if k < self._c - LOOKBACK or not waiting.any():
            return self._c if waiting.any() else k
        draws = self.conditional(now_s, runtimes, arrived, waiting)
        if draws is None:
            return self._c
        ordered = sorted_samples(draws)
        expected = ordered.mean(axis=0)
        later = k + np.arange(1, expected.size + 1)
        o, rate, n = self.overhead_s, self._rate, int(np.count_nonzero(self._live))
        got, more = float(k), later.astype(float)
        now_end, length, extra = now_s, expected, (None, None)
        if self.salvages:  # the cut ones salvage the micro-batch they are in, and it takes time
            now_extra, now_end = cut_terms(ordered, self.salvage_parts, now=now_s)
            salvage, length = cut_terms(ordered, self.salvage_parts)
            extra = (now_extra, salvage)
        if self._worth is not None:  # what k, and each later j, gradients are worth
            got = float(self.worth_of(np.array([k]), extra[0], n)[0])
            more = self.worth_of(later, extra[1], n)
        value = long_run_value if rate is not None and rate > 0 else iteration_value
        stop, wait = value(got, now_end + o, rate), value(more, length + o, rate)
        best = int(np.argmax(wait))
        return k if stop >= wait[best] else int(later[best])

    def conditional(
        self, now_s: float, runtimes: np.ndarray, arrived: np.ndarray, waiting: np.ndarray
    ) -> np.ndarray | None:
        """(S, n_waiting) samples of the waiting workers' run-times given this iteration so far,
        or None when the policy cannot condition (then revise keeps the chosen c)."""
        return None

    def going_rate(self, expected: np.ndarray) -> float | None:
        """lambda: the rate achieved lately, capped by the recent mean (about 50 iterations) of
        the best rate the predictive offers per iteration, max_c c / E[x_(c)]. A lambda above
        every rate on offer makes c - lambda E[x_(c)] negative for every c and drives c down;
        more workers are then censored, a predictive that sees less grows more pessimistic, and
        c spirals down (seen on drifting clusters, where the achieved rate also remembers
        faster times). Capped, a pessimistic predictive lowers lambda and so waits for more
        workers, which shows it the workers it was wrong about."""
        offered = iteration_rates(expected, self.overhead_s, self._worth)
        self.offered.update(float(offered.max()), 1.0)
        achieved = self.tracker.rate()
        return None if achieved is None else min(achieved, self.offered.rate())

    def spec_name(self, kind: str, default_stopping: str = "fixed") -> str:
        """``kind`` with ``goodput``, the objective and the stopping rule appended unless they
        are the defaults (names key results)."""
        options = ["goodput"] if self.goodput else []
        options += [self.objective] if self.objective != "long-run" else []
        options += [self.stopping] if self.stopping != default_stopping else []
        return ":".join([kind, *options])

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        """Learn from every observed iteration; count it towards lambda only if this policy chose
        its c (history recorded under another policy, e.g. a full-sync profile, says nothing about
        the rate this policy achieves, and would hold lambda far too low for a long time)."""
        if self._decided:
            self.tracker.observe(runtimes, censored, self.overhead_s, self.worth_of_count())
            self.predicted_for(int(np.count_nonzero(~np.asarray(censored, dtype=bool))))
        self._decided = False
        self.learn(runtimes, censored)

    def observe_shadow(
        self, runtimes: np.ndarray, censored: np.ndarray, gradients: int, seconds: float
    ) -> None:
        """:meth:`observe` for an iteration another policy decided while this one chose in its
        shadow (``bdsgd.stages.policies.selfcheck``): lambda counts the ``gradients`` (their worth)
        and ``seconds`` (fixed cost included) this policy would have had; it learns from what
        was seen."""
        worth = self.worth_of_count()
        self.tracker.update(gradients if worth is None else worth(gradients), seconds)
        self._decided = False
        self.learn(runtimes, censored)

    @property
    def salvages(self) -> bool:
        return self.salvage_parts >= 2

    def worth_of(self, counts: np.ndarray, salvage, n: int) -> np.ndarray | None:
        """What ending an iteration at ``counts`` gradients is worth: each count plus the share
        the cut workers ``salvage`` (an array or a number; None: none), as gain() of that under
        ``:goodput`` (with one gradient ruled out while ``n`` >= 2 live); None when it is just
        the count."""
        if salvage is None and not self.goodput:
            return None
        counts = np.asarray(counts, dtype=float)
        worth = counts + (0.0 if salvage is None else salvage)
        if not self.goodput:
            return worth
        worth = np.array(gain(worth, self.noise_scale, self.batch_size), ndmin=1)
        if n >= MIN_MEASURED:
            worth = np.where(counts < MIN_MEASURED, -np.inf, worth)
        return worth

    def worth_of_count(self) -> Callable[[int], float] | None:
        """What k applied gradients count towards lambda: with the share the cut workers
        salvaged at the k-th arrival as this policy's last choice expected it, and gain() of
        that under ``:goodput`` (None: k)."""
        if not self.goodput and self._salvage is None:
            return None
        curve = self._salvage

        def worth(k: int) -> float:
            extra = float(curve[k - 1]) if curve is not None and 1 <= k <= curve.size else 0.0
            base = k + extra
            return gain(base, self.noise_scale, self.batch_size) if self.goodput else base

        return worth

    @abc.abstractmethod
    def learn(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        """Update the source of the samples with one observed iteration."""

    def describe(self) -> dict:
        if self._ordered is None or self._described is None:
            return {}
        q = np.quantile(self._ordered[:, self._described - 1], QUANTILES) + self.overhead_s
        return {"pred_q10": float(q[0]), "pred_q50": float(q[1]), "pred_q90": float(q[2])}


class EcdfCutoff(MonteCarloCutoff):
    """``ecdf``: resample the pooled run-times of the last ``window`` iterations (the empirical
    distribution, every worker alike)."""

    def __init__(
        self,
        window: int = 50,
        num_samples: int = 256,
        seed: int = 0,
        objective: str = "long-run",
        stopping: str = "fixed",
        goodput: bool = False,
    ) -> None:
        super().__init__(num_samples, objective, stopping, goodput)
        self.name = self.spec_name("ecdf")
        self.window = WindowLogNormal(window)
        self.rng = np.random.default_rng(seed)

    def samples(self, live: np.ndarray) -> np.ndarray | None:
        values = self.window.values()
        if values.size == 0:
            return None
        idx = self.rng.integers(0, values.size, (self.num_samples, int(live.sum())))
        return np.exp(values[idx])

    def conditional(self, now_s, runtimes, arrived, waiting) -> np.ndarray | None:
        """The window's values above ``now_s``, resampled (None when none is)."""
        values = self.window.values()
        above = values[values > np.log(max(now_s, 1e-12))]
        if above.size == 0:
            return None
        idx = self.rng.integers(0, above.size, (self.num_samples, int(np.count_nonzero(waiting))))
        return np.exp(above[idx])

    def learn(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.window.observe(runtimes, censored)


class EwmaCutoff(MonteCarloCutoff):
    """``ewma``: each worker's own log-normal from exponentially weighted log run-times,
    independent across workers."""

    def __init__(
        self,
        num_workers: int,
        alpha: float = 0.1,
        num_samples: int = 256,
        seed: int = 0,
        objective: str = "long-run",
        stopping: str = "fixed",
        goodput: bool = False,
    ) -> None:
        super().__init__(num_samples, objective, stopping, goodput)
        self.name = self.spec_name("ewma")
        self.ewma = EwmaLogNormal(num_workers, alpha=alpha)
        self.rng = np.random.default_rng(seed)

    def samples(self, live: np.ndarray) -> np.ndarray | None:
        if not self.ewma.seen.any():
            return None
        mu, sigma = self.ewma.params()
        z = self.rng.standard_normal((self.num_samples, int(live.sum())))
        return np.exp(mu[live] + sigma[live] * z)

    def conditional(self, now_s, runtimes, arrived, waiting) -> np.ndarray | None:
        """Each waiting worker's own log-normal truncated below at ``now_s`` (independent
        workers: what arrived says nothing about who is still out)."""
        mu, sigma = (v[waiting] for v in self.ewma.params())
        log_above = log_ndtr((mu - np.log(max(now_s, 1e-12))) / sigma)
        u = np.log(self.rng.random((self.num_samples, mu.size))) + log_above
        return np.exp(mu - sigma * ndtri_exp(u))

    def learn(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.ewma.observe(runtimes, censored)


class BdsgdCutoff(MonteCarloCutoff):
    """``bdsgd``: joint samples from the fitted run-time model's posterior predictive."""

    def __init__(
        self,
        predictor: Predictor,
        num_samples: int = 256,
        objective: str = "long-run",
        stopping: str = "online",
        goodput: bool = False,
    ) -> None:
        super().__init__(num_samples, objective, stopping, goodput)
        self.name = self.spec_name("bdsgd", default_stopping="online")
        self.predictor = predictor
        self.record = ArrivalRecord()
        self._ahead: np.ndarray | None = None  # (S, N) draws of the next iteration, taken early
        self._deciding = False  # a choose() was asked: draw ahead after each observation

    def choose(self, live: np.ndarray) -> int:
        """The model's c, raised to the arrival record's floor where that applies
        (:meth:`floored`)."""
        self._deciding = True
        c = super().choose(live)
        if self._c is not None:
            self._c = self._described = c = self.floored(c, live)
        return c

    def revise(self, now_s: float, runtimes: np.ndarray, arrived: np.ndarray) -> int:
        """:meth:`MonteCarloCutoff.revise`, raised at an arrival to the record's floor where
        that applies (:meth:`floored`); at a tick (a worker observably late) the model's own
        revision stands."""
        target = super().revise(now_s, runtimes, arrived)
        at_arrival = now_s <= float(np.max(np.where(arrived, runtimes, 0.0), initial=0.0)) + 1e-9
        if self._live is None or not at_arrival:
            return target
        return self.floored(target, self._live)

    def floored(self, c: int, live: np.ndarray) -> int:
        """The first c' >= c at whose arrival the next gradient does not pay for itself on the
        arrival record (``bdsgd.stages.policies.floor``): the c an iteration then stops at. Only
        for an online policy whose predictor conditions on arrivals, on a cluster of at most
        ``SMALL_N`` live workers, once a rate is known; c itself otherwise."""
        n, rate = int(np.count_nonzero(live)), self.tracker.rate()
        if (
            not self.online
            or self.salvages  # (the next gradient, nearly done, is nearly all salvaged anyway)
            or n > SMALL_N
            or rate is None
            or not hasattr(self.predictor, "remaining")
        ):
            return c
        return self.record.floor(n, rate, start=c)

    def samples(self, live: np.ndarray) -> np.ndarray:
        """The draws taken ahead, after the last observation (:meth:`learn`), else fresh ones:
        the predictive does not change between an observation and the next decision, so the
        sampling is done off the decision's critical path."""
        draws, self._ahead = self._ahead, None
        if draws is None:
            draws = self.draw()
        return draws if live.all() else draws[:, live]  # (a copy of S x N costs 0.2 ms)

    def draw(self) -> np.ndarray:
        """(S, N) joint draws of the next iteration (and the predictor's conditional set up)."""
        with torch.no_grad():
            draws = self.predictor.sample(self.num_samples).detach().cpu().numpy()
        prepare = getattr(self.predictor, "prepare", None)
        if prepare is not None:
            prepare()
        return draws

    def conditional(self, now_s, runtimes, arrived, waiting) -> np.ndarray | None:
        """The model's joint predictive of the waiting workers given the arrivals: a host whose
        workers are late is likely slowed down as a whole (see ``predictor.Arrivals``).
        None for a predictor that cannot condition (it then serves the fixed-c rule)."""
        remaining = getattr(self.predictor, "remaining", None)
        return None if remaining is None else remaining(now_s, runtimes, arrived, waiting)

    def learn(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        """Advance the record and the model's filter; once the policy decides, draw the next
        iteration's samples now (see :meth:`samples`) from a predictor that sets up its
        conditional ahead too (``prepare``, as the fitted model's does)."""
        self.record.observe(runtimes, censored)
        self.predictor.observe(runtimes, censored)
        ahead = self._deciding and hasattr(self.predictor, "prepare")
        self._ahead = self.draw() if ahead else None
