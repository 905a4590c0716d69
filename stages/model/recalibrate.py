"""After training: a log-slowdown shared by every worker, so that the predictive of the order
statistic a policy cuts at is calibrated.

The model's joint predictive can get each worker's run-time right and still misjudge x_(c), the
c-th arrival a cutoff policy waits for: x_(c) at c near N's three quarters depends on how much
of the workers' variation is shared from one iteration to the next, and a slight bias common to
all workers moves every order statistic at once. On the held-out parts of the benchmark clusters
the run-times were inside their central 90% interval 89-92% of the time, x_(c) only 79-89%
(``docs/benchmarks.md``). Measured on the end of the training part instead, the shift came out
near zero where the held-out part needed one: the network looks better on iterations it was
trained on (syn0: x_(c) covered 74.5% on the last 10% of the run, against 90% measured on the
held-out half).

:func:`common_slowdown` measures it on the first half of each run's held-out part
(:func:`recalibration_spans`; ``fit`` then reports calibration on the second half only): for
each iteration, the predictive draws of the normalised log x_(c) and the
observed value. The shift is the median residual of the observed value from the draws' median;
the spread is the smallest (in steps of 0.01) with which the central 90% interval of the draws,
shifted and widened, holds at least 90% of the observed values there. The predictor then adds ``shift + spread * e`` (one ``e ~ N(0, 1)`` per joint
draw, shared by every worker) to every worker's normalised log run-time
(:class:`bdsgd.stages.model.predictor.RuntimePredictor`, ``common``): x_(c) moves and widens by exactly
that, the marginals by the same small amount.

Before that, where the exact run-times of the span are clearly under-covered (less than 85%
inside their central 90% interval), every worker's own spread is widened by the factor of
``WIDENINGS`` under which they are likeliest (:func:`widening`). Of the benchmark clusters only
``load`` needs it: its
held-out part runs at a load level, with a wider tail, that the training part never had, and
its run-times were covered 80% of the time. Widening where 89% were covered (gammamix) cost a
point of throughput, hence the threshold.

A shared spread can only widen x_(c)'s predictive. Where the span's x_(c) are clearly
over-covered (more than ``TIGHTEN_ABOVE`` inside once shifted), :func:`tightened` instead narrows
the spread of the draws' shared levels (the predictor's ``common[3]``, see
:meth:`bdsgd.stages.model.predictor.RuntimePredictor.sample`) by the strongest factor of
``TIGHTENINGS`` that still covers 90% of them. On ``load``, widened by 1.35 for its run-times,
x_(c) was covered 97% on the span and 98% after it. All of this is measured once; where the
cluster keeps changing after the span, the predictor goes on adjusting x_(c)'s spread online
(:mod:`bdsgd.stages.model.online`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from bdsgd.stages.model.checkpoint import Checkpoint
from bdsgd.stages.model.evaluate import Filtered, _observed, split, start_at
from bdsgd.stages.model.online import order_statistic_at_cut
from bdsgd.stages.store import RunMatrix

SHARE = 0.25  # without a held-out part: the share of each run, at its end, measured on
MIN_ITERATIONS = 20  # fewer usable iterations than this: no recalibration
TARGET = 0.9  # the share of x_(c) the central 90% interval should hold
SPREADS = np.arange(0.0, 2.005, 0.01)  # the spreads tried (normalised log units), smallest first
WIDENINGS = np.array([1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0])  # factors tried on workers' spreads
WIDEN_BELOW = 0.85  # run-times covered less than this on the span: widen the workers' spreads
TIGHTEN_ABOVE = 0.95  # x_(c) covered more than this on the span (shifted): narrow its spread
TIGHTENINGS = np.array([0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])  # strongest first


def span_draws(
    ckpt: Checkpoint,
    run: RunMatrix,
    begin: int,
    end: int,
    samples: int,
    seed: int,
    settings: list[tuple[float, ...]],
    filtered: Filtered | None = None,
) -> tuple[np.ndarray, list[list[np.ndarray]], list[list[float]]]:
    """At iterations ``begin <= t < end`` of one run (filtered from 0), for every recalibration
    of ``settings`` (``common`` tuples): the share of exact run-times inside their central 90%
    interval (one per setting), and per setting the predictive draws of the normalised log
    x_(c) and its observed value where the iteration shows it (the draws of every setting come
    from the same filter state)."""
    # the draws of every setting from the same state, none adjusted by the online spread
    predictor, first = start_at(ckpt, run, begin, seed, filtered, online=False)
    norm = ckpt.norm
    inside, count = np.zeros(len(settings)), 0
    predicted: list[list[np.ndarray]] = [[] for _ in settings]
    seen: list[list[float]] = [[] for _ in settings]
    for t in range(first, end):
        x, cens, present = _observed(run, t)
        if t >= begin and present.any():
            exact = present & ~cens
            count += int(exact.sum())
            for i, setting in enumerate(settings):
                predictor.common = setting
                draws = predictor.sample(samples).numpy()
                pit = (draws[:, exact] < x[exact]).mean(axis=0)
                inside[i] += np.sum((pit >= 0.05) & (pit <= 0.95))
                cut = order_statistic_at_cut(draws, x, cens, present)
                if cut is not None:
                    predicted[i].append((np.log(cut[1]) - norm.loc) / norm.scale)
                    seen[i].append(float((np.log(cut[2]) - norm.loc) / norm.scale))
        predictor.observe(x, cens)
    return inside / max(count, 1), predicted, seen


def pooled_draws(
    ckpt: Checkpoint,
    runs: list[RunMatrix],
    spans: list[tuple[int, int]],
    samples: int,
    seed: int,
    settings: list[tuple[float, ...]],
    filtered: Filtered | None = None,
) -> tuple[np.ndarray, list[list[np.ndarray]], list[list[float]]]:
    """:func:`span_draws` over every run's span: run-time coverage averaged over runs, the x_(c)
    draws and observed values pooled."""
    coverage = np.zeros(len(settings))
    predicted: list[list[np.ndarray]] = [[] for _ in settings]
    seen: list[list[float]] = [[] for _ in settings]
    for run, (begin, end) in zip(runs, spans, strict=True):
        cover, p, s = span_draws(ckpt, run, begin, end, samples, seed, settings, filtered)
        coverage += cover / len(runs)
        for i in range(len(settings)):
            predicted[i] += p[i]
            seen[i] += s[i]
    return coverage, predicted, seen


def span_scores(
    ckpt: Checkpoint,
    runs: list[RunMatrix],
    spans: list[tuple[int, int]],
    samples: int,
    seed: int,
    settings: list[tuple[float, ...]],
    filtered: Filtered | None = None,
) -> np.ndarray:
    """The summed one-step log predictive (nats) of every run's span under each of
    ``settings``: a proper score of the run-times there. A pass of its own, taken only where
    :func:`widening` needs it (a log predictive costs 2-5 draws' worth)."""
    scores = np.zeros(len(settings))
    for run, (begin, end) in zip(runs, spans, strict=True):
        predictor, first = start_at(ckpt, run, begin, seed, filtered, online=False)
        for t in range(first, end):
            x, cens, present = _observed(run, t)
            if t >= begin and present.any():
                for i, setting in enumerate(settings):
                    predictor.common = setting
                    scores[i] += predictor.log_predictive(x, cens, samples)[0]
            predictor.observe(x, cens)
    return scores


def widening(coverage: float, scores: Callable[[], np.ndarray]) -> int:
    """Which of :data:`WIDENINGS` to take: none (index 0) unless the span's run-times are
    clearly under-covered unwidened (``coverage`` under :data:`WIDEN_BELOW`: a factor of 1.1
    where 89% were covered cost gammamix a point of throughput); then the one under which they
    are likeliest (``scores()``, one per factor). Not the smallest that covers 90% of them, nor
    the widest where none does, as before: a wider bulk cannot cover values that the tail or a
    host's jump should (a host's slow spells given too small a chance), and the widest factor
    doubled the bulk of a 4-rank job's next run (its run-time PIT KS 0.31, against 0.13
    unwidened; docs/decisions.md)."""
    if coverage >= WIDEN_BELOW:
        return 0
    return int(np.argmax(scores()))  # (the first of equals: the least widening)


def order_stat_coverage(draws: np.ndarray, seen: np.ndarray) -> float:
    """Share of observed x_(c) (I,) inside the central 90% interval of their (I, S) draws."""
    pit = (draws < seen[:, None]).mean(axis=1)
    return float(np.mean((pit >= 0.05) & (pit <= 0.95)))


def recalibration_spans(runs: list[RunMatrix], holdout: float) -> list[tuple[int, int]]:
    """The iterations ``[begin, end)`` of each run the shared slowdown is measured on: the first
    half of the held-out part (iterations the network never trained on; fit then reports
    calibration on the second half only), or without a held-out part the last ``SHARE`` of
    the run (in-sample: the network trained on them, and tends to look better there)."""
    spans = []
    for run in runs:
        t = run.shape[0]
        if holdout > 0:
            start = split(t, holdout)
            spans.append((start, start + max(1, (t - start) // 2)))
        else:
            spans.append((max(1, t - max(1, int(SHARE * t))), t))
    return spans


def common_slowdown(
    ckpt: Checkpoint,
    runs: list[RunMatrix],
    spans: list[tuple[int, int]],
    samples: int = 128,
    seed: int = 0,
    filtered: Filtered | None = None,
) -> tuple[float, float, float, float]:
    """(shift, sd) of the shared log-slowdown, in normalised log units, the factor on the
    workers' own spreads and the one on the spread of the draws' locations, measured on
    iterations ``spans[i]`` of each run (see the module docstring); no shared slowdown with
    fewer than ``MIN_ITERATIONS`` usable iterations."""
    settings = [(0.0, 0.0, float(w), 1.0) for w in WIDENINGS]
    coverage, predicted, seen = pooled_draws(ckpt, runs, spans, samples, seed, settings, filtered)
    scores = partial(span_scores, ckpt, runs, spans, samples, seed, settings, filtered)
    k = widening(float(coverage[0]), scores)  # then the shared slowdown that covers x_(c) with it
    widen = float(WIDENINGS[k])
    if len(seen[k]) < MIN_ITERATIONS:
        return 0.0, 0.0, widen, 1.0
    draws, seen_at = np.stack(predicted[k]), np.asarray(seen[k])  # (I, S), (I,)
    shift = float(np.median(seen_at - np.median(draws, axis=1)))
    if order_stat_coverage(draws + shift, seen_at) > TIGHTEN_ABOVE:
        return tightened(ckpt, runs, spans, samples, seed, widen, filtered)
    noise = np.random.default_rng(seed).standard_normal(draws.shape[1])
    for sd in SPREADS:
        if order_stat_coverage(draws + shift + sd * noise, seen_at) >= TARGET:
            return shift, float(sd), widen, 1.0
    return shift, float(SPREADS[-1]), widen, 1.0


def tightened(
    ckpt: Checkpoint,
    runs: list[RunMatrix],
    spans: list[tuple[int, int]],
    samples: int,
    seed: int,
    widen: float,
    filtered: Filtered | None = None,
) -> tuple[float, float, float, float]:
    """Where x_(c) is clearly over-covered: the shift and the strongest narrowing of
    ``TIGHTENINGS`` with which the span's x_(c) are still covered ``TARGET``."""
    settings = [(0.0, 0.0, widen, float(f)) for f in TIGHTENINGS]
    _, predicted, seen = pooled_draws(ckpt, runs, spans, samples, seed, settings, filtered)
    for i, factor in enumerate(TIGHTENINGS):
        draws, seen_at = np.stack(predicted[i]), np.asarray(seen[i])
        shift = float(np.median(seen_at - np.median(draws, axis=1)))
        if order_stat_coverage(draws + shift, seen_at) >= TARGET:
            return shift, 0.0, widen, float(factor)
    return shift, 0.0, widen, 1.0
