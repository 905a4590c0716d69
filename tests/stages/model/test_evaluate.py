"""Held-out predictive NLL: the split, the baselines, and the model beating them."""

from __future__ import annotations

import numpy as np
import pytest
from bdsgd.stages.estimators import EwmaLogNormal, lognormal_logpdf_or_logsf
from bdsgd.stages.fit import FitConfig, run_fit
from bdsgd.stages.model.evaluate import (
    PitCollector,
    baseline_log_lik,
    ks_distance,
    pit_summary,
    split,
)
from bdsgd.stages.store import RunMatrix, TraceStore

from tests.stages.model.clusters import drifting_cluster, write_run


def test_split_holds_out_the_last_share():
    assert split(100, 0.2) == 80
    assert split(3, 0.2) == 2
    assert split(10, 0.9) == 1


def test_ewma_baseline_scores_each_held_out_step_before_observing_it():
    x, cens, hosts = drifting_cluster(30, 3, 1, seed=0, cutoff=2)
    run = RunMatrix("r", x, cens, np.ones_like(cens), tuple(hosts))
    ewma, expected = EwmaLogNormal(3), 0.0
    for t in range(30):
        if t >= 24:
            expected += lognormal_logpdf_or_logsf(x[t], cens[t], *ewma.params()).sum()
        ewma.observe(x[t], cens[t])
    assert np.isclose(baseline_log_lik(run, 24)[1], expected)


def test_model_beats_window_and_ewma_on_a_drifting_host_correlated_cluster(tmp_path):
    """Hosts wander and fall into slow spells together, the cluster speed shifts in steps, one run
    is censored at a cutoff: the model must predict the held-out tail better than both."""
    store = TraceStore(tmp_path / "traces")
    write_run(store, "run-1", *drifting_cluster(400, 12, 3, seed=10))
    write_run(store, "run-2", *drifting_cluster(300, 12, 3, seed=20, cutoff=10))
    config = FitConfig(
        traces=store.path,
        checkpoint=tmp_path / "m.pt",
        steps=60,
        window=32,
        batch=8,
        eval_samples=128,
        progress=False,
    )
    result = run_fit(config)
    assert result.val_nll < result.baseline_nll["ewma"] - 0.05
    assert result.val_nll < result.baseline_nll["window"] - 0.05


def _collect(spread: float, censor_above: float | None = None, seed: int = 0) -> dict:
    """PITs of 300 iterations x 20 workers of independent log-normals (sd 0.7) under a
    predictive of sd ``spread`` (0.7 is the truth); values above ``censor_above`` censored."""
    rng = np.random.default_rng(seed)
    pits = PitCollector()
    mu = np.linspace(-0.5, 0.5, 20)
    for _ in range(300):
        x = np.exp(mu + 0.7 * rng.standard_normal(20))
        cens = np.zeros(20, dtype=bool) if censor_above is None else x > censor_above
        draws = np.exp(mu + spread * rng.standard_normal((256, 20)))
        pits.add(draws, np.where(cens, censor_above or 0.0, x), cens, np.ones(20, dtype=bool))
    return pits.summary()


def test_a_fixed_c_scores_that_order_statistic_whatever_the_draws_favour():
    """PitCollector(c) takes x_(c) at the given c, not the best c of the draws (3 of 4 here);
    logs of the same draws and values give the same PITs, since only their order counts."""
    draws = np.tile([1.0, 1.1, 1.2, 50.0], (8, 1)) * np.linspace(0.9, 1.1, 8)[:, None]
    x = np.array([0.95, 1.0, 1.15, 60.0])
    every = np.ones(4, dtype=bool)
    best = PitCollector()
    best.add(draws, x, ~every, every)
    assert best.cutoffs == [3] and best.order == [0.375]  # 1.15 above 3 of 8 of 1.2 * 0.9-1.1
    for values, seen in ((draws, x), (np.log(draws), np.log(x))):
        fixed = PitCollector(c=4)
        fixed.add(values, seen, ~every, every)
        assert fixed.cutoffs == [4] and fixed.order == [1.0]  # 60 above every 50 * 0.9-1.1
        assert fixed.runtime[0].tolist() == best.runtime[0].tolist()


def test_calibration_covers_90_percent_under_the_true_predictive():
    summary = _collect(0.7)
    for key in ("runtime", "order_stat"):
        assert 0.87 <= summary[key]["coverage"] <= 0.93 and summary[key]["ks"] < 0.05
        assert np.isclose(sum(summary[key]["histogram"]), 1.0)
    assert summary["runtime"]["count"] == 6000 and summary["order_stat"]["count"] == 300
    assert 1 <= summary["order_stat"]["mean_c"] <= 20


def test_calibration_flags_a_predictive_too_sure_or_too_vague():
    narrow, wide = _collect(0.3), _collect(1.4)
    assert narrow["runtime"]["coverage"] < 0.6 and narrow["order_stat"]["coverage"] < 0.7
    assert wide["runtime"]["coverage"] > 0.98
    # too sure: the PITs pile up in the outer bins; too vague: in the middle
    assert narrow["runtime"]["histogram"][0] + narrow["runtime"]["histogram"][-1] > 0.4
    assert wide["runtime"]["histogram"][0] + wide["runtime"]["histogram"][-1] < 0.05


def test_calibration_skips_censored_values_and_order_statistics_it_cannot_see():
    summary = _collect(0.7, censor_above=1.0)
    assert 2000 < summary["runtime"]["count"] < 6000  # the censored run-times are left out
    # x_(c) is scored only where the c smallest values were all seen exactly
    assert 0 < summary["order_stat"]["count"] < 300


def test_the_ks_distance_takes_both_sides_of_each_step():
    # three values at the top: the gap is below the steps (u_(i) - (i-1)/n), not above them
    assert ks_distance(np.array([0.9, 0.9, 0.9])) == pytest.approx(0.9)
    assert ks_distance(np.array([0.1, 0.1, 0.1])) == pytest.approx(0.9)
    assert ks_distance(np.array([1 / 6, 0.5, 5 / 6])) == pytest.approx(1 / 6)


def test_the_ks_distance_is_judged_against_what_a_calibrated_predictive_gives_at_its_count():
    calibrated, narrow = _collect(0.7), _collect(0.3)
    for key in ("runtime", "order_stat"):
        assert calibrated[key]["ks"] <= calibrated[key]["ks_p95"] and calibrated[key]["ks_p"] > 0.05
        assert narrow[key]["ks"] > narrow[key]["ks_p95"] and narrow[key]["ks_p"] < 0.01
    # fewer values, a wider band: 300 x_(c) values against 6,000 run-times
    assert calibrated["order_stat"]["ks_p95"] > 3 * calibrated["runtime"]["ks_p95"]


@pytest.mark.parametrize("n", [1, 7, 41, 240, 720, 6400])
def test_the_ks_bound_and_chance_agree_with_the_exact_two_sided_distribution(n):
    from scipy.stats import kstwo  # the exact two-sided distribution pit_summary avoids importing

    u = np.random.default_rng(n).random(n) ** 1.2  # leaning a little: a KS well above zero
    found = pit_summary(u)
    assert found["ks_p95"] == pytest.approx(kstwo.ppf(0.95, n), abs=1e-6)
    exact = kstwo.sf(found["ks"], n)
    assert exact <= found["ks_p"] + 1e-12  # an upper bound ...
    if exact < 0.3:  # ... and the chance itself where it says anything
        assert found["ks_p"] == pytest.approx(exact, abs=1e-3)
    assert pit_summary(np.zeros(0))["ks_p"] is None


def test_a_fit_does_not_import_scipy_stats():
    import subprocess
    import sys

    code = (
        "import sys, numpy, bdsgd.stages.fit; from bdsgd.stages.model.evaluate import pit_summary; "
        "pit_summary(numpy.linspace(0, 1, 50)); print('scipy.stats' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
