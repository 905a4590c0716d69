"""Clusters unlike the project's own generators, for the held-out benchmark and the tests.

``SyntheticCluster`` (and ``arrack``/``throttle`` in :mod:`benchmarks.bench_heldout`) put several
workers on each host and make hosts slow down together: the host machinery of the model has
something to find. The clusters here have **one worker per host** (host names carry no
information) and **nearly independent heavy tails**, the shape of serverless or spot workers:

- :func:`lognormal_wide`: per-worker log-normals with a large spread (sigma 0.6-1.1);
- :func:`pareto_tails`: a per-worker base times ``1 + Pareto(alpha)``, alpha 1.3-2.2 (some
  workers have an infinite variance);
- :func:`gamma_mixture`: a two-component gamma mixture per worker (a fast mode and, 20% of the
  time, a three-fold slower, more variable one);
- :func:`load_levels`: the run-time grows with a load level that moves between 1.0 and 2.2 in
  blocks over the first 80% of the run and sits at an unseen 1.6 (with a wider tail) in the rest:
  the fit sees other load levels than the replay;
- :func:`short_runs`: many runs of 50 iterations each (a fresh set of workers per run), so every
  run is short and its held-out tail is 10 iterations;
- :func:`level_runs`: short runs (30 iterations, 256 workers) of the same workers at different
  load levels, each with its own level: fitted on some levels, replayed at one below (or above)
  all of them. Within a run the workers' order is nearly random from one iteration to the next,
  while each worker's mean keeps its place across runs; a narrow body, a sharp tail, and the
  first two iterations of every run slower.

Every generator is a pure function of its seed: ``(T, N) run-times in seconds, N host names``
(:func:`short_runs`: a list of those). A weak common factor (a shared log-normal with sd 0.03-0.05
per iteration) keeps the workers *nearly*, not exactly, independent.
"""

from __future__ import annotations

import numpy as np

Cluster = tuple[np.ndarray, list[str]]


def one_host_each(workers: int, prefix: str = "fn") -> list[str]:
    """A distinct host name per worker (one worker per host)."""
    return [f"{prefix}{w}" for w in range(workers)]


def common_factor(rng: np.random.Generator, iterations: int, sd: float) -> np.ndarray:
    """(T, 1) shared log-slowdown per iteration: weak correlation between workers."""
    return rng.normal(0.0, sd, (iterations, 1))


def lognormal_wide(seed: int, iterations: int, workers: int) -> Cluster:
    """log x = base_w + common_t + sigma_w eps, base_w ~ N(log 0.1, 0.3), sigma_w ~ U(0.6, 1.1)."""
    rng = np.random.default_rng(seed)
    base = np.log(0.1) + rng.normal(0.0, 0.3, workers)
    sigma = rng.uniform(0.6, 1.1, workers)
    eps = rng.standard_normal((iterations, workers))
    logs = base + common_factor(rng, iterations, 0.05) + sigma * eps
    return np.exp(logs), one_host_each(workers)


def pareto_tails(seed: int, iterations: int, workers: int) -> Cluster:
    """x = b_w (1 + Pareto(alpha_w)) e^{common_t + 0.1 eps}, b_w ~ 0.05 e^{N(0, 0.2)},
    alpha_w ~ U(1.3, 2.2)."""
    rng = np.random.default_rng(seed)
    base = 0.05 * np.exp(rng.normal(0.0, 0.2, workers))
    alpha = rng.uniform(1.3, 2.2, workers)
    tail = rng.pareto(alpha, (iterations, workers))
    jitter = np.exp(common_factor(rng, iterations, 0.03) + rng.normal(0, 0.1, tail.shape))
    return base * (1.0 + tail) * jitter, one_host_each(workers)


def gamma_mixture(seed: int, iterations: int, workers: int) -> Cluster:
    """x = b_w G, G ~ Gamma(shape 8, mean 1) w.p. 0.8, else Gamma(shape 2, mean 3);
    b_w ~ 0.04 e^{N(0, 0.25)}."""
    rng = np.random.default_rng(seed)
    base = 0.04 * np.exp(rng.normal(0.0, 0.25, workers))
    slow = rng.random((iterations, workers)) < 0.2
    fast_draw = rng.gamma(8.0, 1.0 / 8.0, (iterations, workers))
    slow_draw = rng.gamma(2.0, 3.0 / 2.0, (iterations, workers))
    g = np.where(slow, slow_draw, fast_draw)
    return base * g * np.exp(common_factor(rng, iterations, 0.03)), one_host_each(workers)


def load_schedule(iterations: int, heldout_from: float = 0.8, block: int = 100) -> np.ndarray:
    """(T,) load level: blocks of ``block`` iterations cycling 1.0, 2.2, 1.3, 1.9 before
    ``heldout_from`` of the run, then 1.6 (a level the head never had)."""
    levels = np.array([1.0, 2.2, 1.3, 1.9])
    t = np.arange(iterations)
    load = levels[(t // block) % levels.size]
    load[t >= int(heldout_from * iterations)] = 1.6
    return load


def load_levels(seed: int, iterations: int, workers: int) -> Cluster:
    """log x = base_w + log(load_t) + common_t + sigma(load_t) eps, sigma = 0.25 + 0.3 (load - 1)
    for the blocks of the head and 0.25 + 0.5 (load - 1) in the held-out tail (a heavier tail
    at a new level); base_w ~ N(log 0.05, 0.2)."""
    rng = np.random.default_rng(seed)
    load = load_schedule(iterations)
    tail_part = np.arange(iterations) >= int(0.8 * iterations)
    sigma = 0.25 + np.where(tail_part, 0.5, 0.3) * (load - 1.0)
    base = np.log(0.05) + rng.normal(0.0, 0.2, workers)
    eps = rng.standard_normal((iterations, workers))
    logs = (
        base + np.log(load)[:, None] + common_factor(rng, iterations, 0.04) + sigma[:, None] * eps
    )
    return np.exp(logs), one_host_each(workers)


def short_runs(seed: int, runs: int, workers: int, iterations: int = 50) -> list[Cluster]:
    """``runs`` runs of ``iterations`` each, every one :func:`lognormal_wide` with its own seed
    (its own workers' bases and spreads), all on the same host names."""
    return [lognormal_wide(seed * 1000 + r, iterations, workers) for r in range(runs)]


LEVELS_FITTED = (0.97, 1.16, 1.47, 1.80)  # level_runs: the median run-times of the fitted runs
LEVEL_BELOW, LEVEL_ABOVE = 0.65, 2.4  # the replayed run's level: below or above every fitted one
WARM_UP = (0.69 / 0.65, 0.86 / 0.65)  # the first two iterations against the run's level
TAIL_P, TAIL_LOG = 0.16, (0.38, 0.24)  # share of entries in the tail; its log slowdown N(mu, sd)


def level_runs(
    seed: int, levels: tuple[float, ...], workers: int = 256, iterations: int = 30
) -> list[Cluster]:
    """One run of ``iterations`` per level in ``levels`` (median run-time, seconds), the same
    ``workers`` (one per host) in every run. Relative to its iteration's median a run-time is
    ``exp(u_w + 0.035 e)``, times ``exp(T)`` with ``T ~ N(0.38, 0.24)`` (at least 0.05) with
    worker w's own probability ``p_w`` (mean 0.16, log-normal across workers with sd 0.7): a
    narrow body (q10 0.95) and a tail that starts sharply (q87.5 1.2, q95 1.63, q99 2.1). The
    worker's own offset ``u_w ~ N(0, 0.01)`` and ``p_w`` are drawn once, so a worker's mean keeps
    its place across runs (rank correlation about 0.6) while its place within a run is nearly
    random from one iteration to the next (about 0.08). Every iteration moves by a shared
    ``N(0, 0.015)`` in log; the first two are 1.06 and 1.32 times slower than the rest."""
    rng = np.random.default_rng(seed)
    offset = rng.normal(0.0, 0.01, workers)
    propensity = np.exp(rng.normal(0.0, 0.7, workers))
    p_tail = TAIL_P * propensity / propensity.mean()
    warm = np.ones(iterations)
    warm[: len(WARM_UP)] = WARM_UP[:iterations]
    runs = []
    for level in levels:
        body = rng.normal(0.0, 0.035, (iterations, workers))
        slow = rng.random((iterations, workers)) < p_tail
        tail = slow * np.maximum(rng.normal(*TAIL_LOG, (iterations, workers)), 0.05)
        logs = offset + body + tail + common_factor(rng, iterations, 0.015)
        logs -= np.median(logs[len(WARM_UP) :])  # the run's level is its median after warm-up
        runs.append((level * warm[:, None] * np.exp(logs), one_host_each(workers)))
    return runs
