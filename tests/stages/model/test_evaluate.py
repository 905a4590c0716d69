"""Held-out predictive NLL: the split, the baselines, and the model beating them."""

from __future__ import annotations

import numpy as np

from stages.fit import FitConfig, run_fit
from stages.model.evaluate import baseline_log_lik, split
from stages.policies.estimators import EwmaLogNormal, lognormal_logpdf_or_logsf
from stages.store import RunMatrix, TraceStore
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
