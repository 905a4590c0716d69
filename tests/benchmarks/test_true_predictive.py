"""The true predictive of a synthetic cluster, against which the model's draws are compared."""

from __future__ import annotations

import numpy as np
from bdsgd.stages.model.evaluate import ks_distance
from bdsgd.stages.stragglers import SyntheticCluster

from benchmarks.bench_heldout import SYNTHETIC
from benchmarks.true_predictive import true_draws


def test_the_true_predictive_is_calibrated_on_its_own_cluster():
    """Every run-time of 300 iterations of `harsh` (16 workers) under the draws made before
    it: uniform PITs (4,784 values; a calibrated KS stays under 0.02 in 95% of samples)."""
    cluster = SyntheticCluster(**SYNTHETIC["harsh"])
    terms = cluster.log_delays(300, 16)
    rng = np.random.default_rng(1)
    pits = [(true_draws(cluster, terms, t, 512, rng) < terms[:, t].sum(0)).mean(0)
            for t in range(1, 300)]  # fmt: skip
    assert ks_distance(np.concatenate(pits)) < 0.03


def test_a_host_regime_that_never_changes_is_drawn_as_it_was():
    """With p_recover = p_slow = 0 a host slow at t - 1 is slow in every draw of t, and the
    others in none: the draws differ from the true value by noise only (no spikes)."""
    settings = {**SYNTHETIC["harsh"], "p_recover": 0.0, "p_slow": 0.0, "spike_p": 0.0}
    cluster = SyntheticCluster(**settings)
    terms = cluster.log_delays(5, 16)
    terms[2, 3:] = 0.0
    terms[2, 3:, 1::8] = np.log(cluster.slow_factor)  # host 1 slow from iteration 3 on
    draws = true_draws(cluster, terms, 4, 2000, np.random.default_rng(0))
    known = terms[0, 4] + terms[1, 4] + terms[2, 4]
    np.testing.assert_allclose((draws - known).mean(0), 0.0, atol=0.02)
    np.testing.assert_allclose((draws - known).std(0), cluster.sigma, rtol=0.1)


def test_a_host_that_goes_slow_at_t_is_drawn_from_its_regime_at_t_minus_1():
    """The draws of t know the regime of t - 1, not t's: with p_slow = 0 a host healthy at
    t - 1 is healthy in every draw of t, even where the truth has it slow at t."""
    settings = {**SYNTHETIC["harsh"], "p_recover": 0.0, "p_slow": 0.0, "spike_p": 0.0}
    cluster = SyntheticCluster(**settings)
    terms = cluster.log_delays(5, 16)
    terms[2] = 0.0
    terms[2, 4, 1::8] = np.log(cluster.slow_factor)  # host 1 slow at 4 only
    draws = true_draws(cluster, terms, 4, 2000, np.random.default_rng(0))
    known = terms[0, 4] + terms[1, 4]  # (no regime term: healthy at 3)
    np.testing.assert_allclose((draws - known).mean(0), 0.0, atol=0.02)


def test_the_spikes_are_the_clusters_log_pareto_slowdowns():
    """With a spike in every cell and no noise, the draws less the known terms are log(1 +
    Pareto(alpha)) draws: their quantiles match a reference sample's."""
    settings = {**SYNTHETIC["harsh"], "p_recover": 0.0, "p_slow": 0.0, "spike_p": 1.0,
                "sigma": 0.0}  # fmt: skip
    cluster = SyntheticCluster(**settings)
    terms = cluster.log_delays(3, 16)
    terms[2] = 0.0
    spikes = true_draws(cluster, terms, 2, 4000, np.random.default_rng(0)) - terms[:2, 2].sum(0)
    reference = np.log1p(np.random.default_rng(1).pareto(cluster.spike_alpha, 64_000))
    q = [0.1, 0.5, 0.9]
    np.testing.assert_allclose(np.quantile(spikes, q), np.quantile(reference, q), rtol=0.05)
