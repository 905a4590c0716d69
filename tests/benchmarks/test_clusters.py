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
