"""The clusters unlike ours: one worker per host, heavy and nearly independent tails."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import clusters

SINGLE = [clusters.lognormal_wide, clusters.pareto_tails, clusters.gamma_mixture,
          clusters.load_levels]  # fmt: skip


@pytest.mark.parametrize("make", SINGLE)
def test_one_worker_per_host_reproducible_positive_and_nearly_independent(make):
    x, hosts = make(3, 400, 24)
    np.testing.assert_array_equal(x, make(3, 400, 24)[0])
    assert not np.array_equal(x, make(4, 400, 24)[0])
    assert x.shape == (400, 24) and np.all(np.isfinite(x)) and np.all(x > 0)
    assert len(set(hosts)) == 24
    logs = np.log(x[:300])  # before load_levels' held-out level
    if make is clusters.load_levels:
        logs = logs - np.log(clusters.load_schedule(400))[:300, None]
    corr = np.corrcoef(logs - logs.mean(axis=0), rowvar=False)[np.triu_indices(24, 1)]
    assert np.abs(np.median(corr)) < 0.1


def test_heavy_tails():
    # the slowest of a row is far above the row's median: a cutoff pays off
    for make in SINGLE:
        x, _ = make(0, 300, 64)
        assert np.median(x.max(axis=1) / np.median(x, axis=1)) > 2.5, make.__name__


def test_load_levels_replays_a_level_the_fitted_part_never_had():
    load = clusters.load_schedule(1000)
    head, tail = set(load[:800]), set(load[800:])
    assert tail == {1.6} and 1.6 not in head and len(head) == 4
    x, _ = clusters.load_levels(0, 1000, 32)
    assert 1.3 < np.exp(np.median(np.log(x[800:])) - np.median(np.log(x[:100]))) < 1.9


def test_short_runs_are_many_runs_of_fifty_iterations_with_their_own_workers():
    runs = clusters.short_runs(2, 5, 16)
    assert len(runs) == 5 and all(x.shape == (50, 16) for x, _ in runs)
    assert all(hosts == runs[0][1] for _, hosts in runs)
    assert not np.allclose(runs[0][0], runs[1][0])


def _rank_corr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1])


def test_level_runs_have_the_levels_given_and_the_character_of_the_trace_they_copy():
    levels = (*clusters.LEVELS_FITTED, clusters.LEVEL_BELOW)
    runs = clusters.level_runs(31, levels)
    assert [x.shape for x, _ in runs] == [(30, 256)] * 5
    assert all(len(set(hosts)) == 256 and hosts == runs[0][1] for _, hosts in runs)
    for (x, _), level in zip(runs, levels, strict=True):
        medians = np.median(x, axis=1)
        np.testing.assert_allclose(np.median(x[2:]), level, rtol=1e-9)
        assert medians[1] > 1.2 * medians[0] > 1.2 * level  # the first two iterations slower
        rel = np.quantile(x / medians[:, None], [0.1, 0.875, 0.95, 0.99])
        np.testing.assert_allclose(rel, [0.94, 1.2, 1.65, 2.1], rtol=0.06)
        within = np.mean([_rank_corr(x[t], x[t + 1]) for t in range(29)])
        assert within < 0.15  # a worker's place is nearly random from one iteration to the next
    means = [x.mean(axis=0) for x, _ in runs]
    across = [_rank_corr(means[i], means[j]) for i in range(5) for j in range(i)]
    assert 0.4 < min(across) and max(across) < 0.8  # ... while its mean keeps its place
    above = clusters.level_runs(31, (clusters.LEVEL_ABOVE,))[0][0]
    np.testing.assert_allclose(above / clusters.LEVEL_ABOVE, runs[0][0] / levels[0])
