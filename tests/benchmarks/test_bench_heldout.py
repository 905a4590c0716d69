"""The held-out benchmark's clusters and trace store (the fit/simulate path is tested elsewhere)."""

from __future__ import annotations

import numpy as np
from bdsgd.stages.model.checkpoint import load_checkpoint
from bdsgd.stages.model.data import NUM_FEATURES
from bdsgd.stages.model.evaluate import PitCollector
from bdsgd.stages.store import TraceStore

from benchmarks.bench_heldout import (
    CLUSTERS,
    Flags,
    RunPits,
    ar_rack_cluster,
    fit_cluster,
    host_options,
    mean_pits,
    throttle_cluster,
    write_store,
)


def test_ar_rack_cluster_is_reproducible_positive_and_host_correlated():
    x, hosts = ar_rack_cluster(0, 600, 16)
    again, _ = ar_rack_cluster(0, 600, 16)
    np.testing.assert_array_equal(x, again)
    assert x.shape == (600, 16) and np.all(np.isfinite(x)) and np.all(x > 0)
    assert len(set(hosts)) == 8 and hosts[0] == hosts[1] != hosts[2]
    logs = np.log(x) - np.log(x).mean(axis=0)
    same_host = np.corrcoef(logs[:, 0], logs[:, 1])[0, 1]
    other_rack = np.corrcoef(logs[:, 0], logs[:, 2])[0, 1]  # host 1 is on the other rack
    assert same_host > other_rack + 0.2


def test_every_cluster_writes_a_store_that_reads_back(tmp_path):
    for name, make in CLUSTERS.items():
        x, hosts = make(20, 8)
        run = write_store(tmp_path / name, x, hosts)
        back = TraceStore(tmp_path / name).run_matrix("heldout")
        np.testing.assert_allclose(back.runtimes, x)
        assert tuple(back.hosts) == run.hosts and not back.censored.any()


def test_throttle_cluster_slows_hosts_down_gradually():
    x, hosts = throttle_cluster(5, 800, 16)
    np.testing.assert_array_equal(x, throttle_cluster(5, 800, 16)[0])
    assert x.shape == (800, 16) and np.all(np.isfinite(x)) and np.all(x > 0)
    host = np.array([int(h[1:]) for h in hosts])
    level = np.stack([np.log(x[:, host == h]).mean(axis=1) for h in range(8)], axis=1)
    steps = np.abs(np.diff(level, axis=0))
    # host levels move a lot over the run but little from one iteration to the next
    assert (level.max(axis=0) - level.min(axis=0)).max() > 0.8
    assert np.median(steps) < 0.2


def test_a_cached_fit_is_reused_only_with_the_same_flags(tmp_path):
    """``fit_cluster`` reuses a checkpoint it fitted (no second fit), but fits again when the
    cached one was fitted with other choices of ``fit`` (host drops, the host regime)."""
    runs = [CLUSTERS["syn0"](120, 8)]
    _, plain = fit_cluster("syn0", runs, 4, tmp_path)
    checkpoint = tmp_path / "syn0.pt"
    written = checkpoint.stat().st_mtime_ns
    _, again = fit_cluster("syn0", runs, 4, tmp_path)
    assert again == plain and checkpoint.stat().st_mtime_ns == written
    assert not load_checkpoint(checkpoint).model.cfg.recovery
    _, drops = fit_cluster("syn0", runs, 4, tmp_path, Flags(host_drops=True))
    assert drops["host_drops"] and not plain["host_drops"]
    assert load_checkpoint(checkpoint).model.cfg.recovery
    _, regime = fit_cluster("syn0", runs, 4, tmp_path, Flags(host_drops=True, host_regime=True))
    assert regime["host_regime"] and not drops["host_regime"]
    assert load_checkpoint(checkpoint).model.cfg.num_features == NUM_FEATURES


def test_flags_name_the_fit_choices_they_hold():
    """A row's flags read a saved fit's choices (one it does not name was off) and say in the
    table's header which ``fit`` options every row used."""
    assert Flags().fitted({"val_nll": 1.0, "auto_host_ks": 0.05})
    assert not Flags(host_regime=True).fitted({"auto_host_ks": 0.05})
    assert not Flags().fitted({"val_nll": 1.0})  # fitted before --auto-host-ks: never refitted
    assert Flags(auto_host_ks=1.0).fitted({"val_nll": 1.0})
    assert Flags(host_drops=True).fitted({"host_drops": True, "auto_host_ks": 0.05})
    assert str(Flags()) == ""
    assert str(Flags(host_drops=True, host_regime=True)) == (
        ", every fit with `--host-drops` `--host-regime`"
    )
    assert str(Flags(auto_host_ks=1.0)) == ", every fit with `--auto-host-ks 1`"


def test_a_row_says_which_host_options_its_model_has_and_whether_a_refit_chose_them():
    both = {"host_drops": True, "host_regime": True}
    assert host_options({"model": both, "auto_host": {"kept": True}}) == "drops + regime (refit)"
    assert host_options({"model": both, "auto_host": None}) == "drops + regime"
    assert host_options({"model": {"host_drops": True, "host_regime": False}}) == "drops"
    assert host_options({"model": {"host_drops": False}, "auto_host": {"kept": False}}) == "-"
    assert host_options({}) == "-"  # saved before fit reported its model


def test_run_pits_set_each_runs_first_iteration_apart():
    """A run's first iteration goes to the whole calibration only, its later ones to both,
    and each of its first iterations to its own position; a second run starts at position 0."""
    whole, seen, at = PitCollector(), PitCollector(), [PitCollector(), PitCollector()]
    draws = np.tile(np.arange(1.0, 11.0)[:, None], (1, 4))  # 10 draws per worker: 1..10
    cens, present = np.zeros(4, bool), np.ones(4, bool)
    for _ in range(2):
        pits = RunPits(whole, seen, at)
        for value in (10.5, 0.5, 5.5):  # PIT 1, then 0, then 0.5, for every worker
            pits.add(draws, np.full(4, value), cens, present)
    assert len(whole.runtime) == 6 and len(seen.runtime) == 4
    assert mean_pits(at[0])[0] == 1.0 and mean_pits(at[1])[0] == 0.0
    assert mean_pits(seen)[0] == 0.25
    assert mean_pits(PitCollector()) == (None, None)
