"""History features and windows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bdsgd.stages.estimators import EwmaLogNormal
from bdsgd.stages.model.data import (
    BASE_FEATURES,
    DEFAULT_FEATURES,
    NUM_FEATURES,
    POSITION_FEATURES,
    HistoryFilter,
    Normaliser,
    host_groups,
    run_history,
    sample_windows,
    subsample_hosts,
    to_tensors,
)
from bdsgd.stages.store import RunMatrix
from bdsgd.stages.stragglers import SyntheticCluster

from tests.stages.model.clusters import drifting_cluster

POSITION = slice(BASE_FEATURES, BASE_FEATURES + POSITION_FEATURES)  # the run position's


def test_slow_history_feature_is_the_ewma_baseline_on_exact_values():
    x, _, hosts = drifting_cluster(80, 5, 2, seed=3, cutoff=4)
    hist, ewma = HistoryFilter(host_groups(hosts)), EwmaLogNormal(5)
    present, exact = torch.ones(5, dtype=torch.bool), np.zeros(5, dtype=bool)
    for t in range(80):
        hist.update(
            torch.as_tensor(np.log(x[t]), dtype=torch.float32), torch.as_tensor(exact), present
        )
        ewma.observe(x[t], exact)
    e, sd, feats, _ = hist.features()
    mu, sigma = ewma.params()
    np.testing.assert_allclose(e.numpy(), mu, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sd.numpy(), sigma, rtol=1e-4)
    assert feats.shape == (5, DEFAULT_FEATURES) and hist.regime is None
    assert HistoryFilter(host_groups(hosts), NUM_FEATURES).features()[2].shape == (5, NUM_FEATURES)


def test_a_bound_below_the_mean_changes_nothing_one_above_raises_it():
    hist = HistoryFilter(host_groups(["a", "a"]))
    present, cut = torch.ones(2, dtype=torch.bool), torch.tensor([True, True])
    for _ in range(5):
        hist.update(torch.zeros(2), torch.zeros(2, dtype=torch.bool), present)
    before = hist.features()
    hist.update(torch.tensor([-0.2, 0.3]), cut, present)  # sd is 0.5: one bound below e, one above
    e, sd, feats, _ = hist.features()
    assert e[0] == before[0][0] and sd[0] == before[1][0]
    assert e[1] > before[0][1] + 0.1 * 0.3  # the truncated mean lies above the bound
    assert feats[0, 4] == 0 and feats[1, 4] > 0  # max(l, 0) c: only the bound above e


def test_host_feature_is_shared_by_a_host_and_missing_entries_change_nothing():
    hist = HistoryFilter(host_groups(["a", "b", "a", "b"]))
    hist.update(torch.zeros(4), torch.zeros(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool))
    hist.update(
        torch.tensor([1.0, 0.0, 3.0, 0.0]),
        torch.zeros(4, dtype=torch.bool),
        torch.ones(4, dtype=torch.bool),
    )
    before = hist.features()[2].clone()
    hist.update(
        torch.full((4,), 9.0), torch.zeros(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool)
    )
    feats = hist.features()[2]
    assert torch.equal(feats, before)  # the run's position too: a row with no entry is none
    assert feats[0, 1] == feats[2, 1] and feats[0, 1] > 0 and feats[1, 1] == 0
    assert torch.equal(before[:, POSITION], torch.tensor([0.0, 1.0, 0.0, 0.81]).expand(4, 4))


def test_the_position_features_mark_the_runs_first_iterations_only():
    """All 0 before the run's first iteration; t == 1, 2, 3 one-hot, and the slow EWMA's weight
    on the first iteration, (1 - alpha)^t, which fades over the run."""
    hist = HistoryFilter(host_groups(["a", "b"]))
    seen = []
    for _ in range(30):
        seen.append(hist.features()[2][0, POSITION].tolist())
        hist.update(
            torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.ones(2, dtype=torch.bool)
        )
    seen = np.array(seen)
    assert seen[0].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert seen[1:4, :3].tolist() == np.eye(3).tolist() and not seen[4:, :3].any()
    np.testing.assert_allclose(seen[1:, 3], 0.9 ** np.arange(1, 30), rtol=1e-6)
    assert HistoryFilter(host_groups(["a"]), BASE_FEATURES).features()[2].shape == (
        1,
        BASE_FEATURES,
    )
    with pytest.raises(ValueError, match="num_features 12.0"):
        HistoryFilter(host_groups(["a"]), 12.0)


def test_rows_without_an_entry_are_no_iteration_of_the_run():
    """An imported log numbered from 1 leaves row 0 empty: the position counts from the first
    row with an entry, as simulate and a resumed train (which skip such rows) count."""
    y = torch.zeros(4, 2)
    present = torch.ones(4, 2, dtype=torch.bool)
    present[0] = False
    feats = run_history(y, torch.zeros_like(present), present, host_groups(["a", "b"]))[2]
    positions = feats[:, 0, POSITION]
    assert positions[:2].tolist() == [[0.0] * 4, [0.0] * 4]  # before the first entry, and at it
    assert positions[2, 0] == 1.0 and positions[3, 1] == 1.0


def test_a_model_without_the_position_features_sees_none():
    """A checkpoint from before the position features: its 8 features are the first 8 of the
    12, at every iteration."""
    x, _, hosts = drifting_cluster(12, 4, 2, seed=1, cutoff=3)
    y = torch.as_tensor(np.log(x), dtype=torch.float32)
    cens, present = torch.zeros_like(y, dtype=torch.bool), torch.ones_like(y, dtype=torch.bool)
    new = run_history(y, cens, present, host_groups(hosts))[2]
    old = run_history(y, cens, present, host_groups(hosts), BASE_FEATURES)[2]
    assert old.shape[-1] == BASE_FEATURES and torch.equal(old, new[..., :BASE_FEATURES])


def test_windows_come_from_one_run_and_keep_its_worker_set():
    runs = []
    for n in (3, 5):
        x, cens, hosts = drifting_cluster(30, n, 2, seed=n)
        run = RunMatrix("r", x, cens, np.ones_like(cens), tuple(hosts))
        runs.append(
            to_tensors(
                run, Normaliser.fit([run]), torch.arange(1, n + 1), torch.ones(n, dtype=torch.long)
            )
        )
    batch = sample_windows(runs, 8, 4, np.random.default_rng(0))
    n = batch.worker_idx.numel()
    assert batch.y.shape == (4, 8, n) and batch.feats.shape == (4, 8, n, DEFAULT_FEATURES)


def test_last_step_features_follow_a_host_step_but_not_one_workers_spike():
    hist = HistoryFilter(host_groups(["a", "a", "a", "b", "b", "b"]))
    ok, everyone = torch.zeros(6, dtype=torch.bool), torch.ones(6, dtype=torch.bool)
    for _ in range(5):
        hist.update(torch.zeros(6), ok, everyone)
    hist.update(torch.tensor([2.0, 2.0, 2.0, 5.0, 0.0, 0.0]), ok, everyone)
    feats = hist.features()[2]
    lag, host, cluster = feats[:, 3], feats[:, 6], feats[:, 7]
    # the slow EWMA has moved by alpha_slow of each step, the last value all of it
    torch.testing.assert_close(lag, 0.9 * torch.tensor([2.0, 2.0, 2.0, 5.0, 0.0, 0.0]))
    torch.testing.assert_close(host, 0.9 * torch.tensor([2.0, 2.0, 2.0, 0.0, 0.0, 0.0]))
    assert torch.all(cluster == cluster[0]) and 0.0 <= cluster[0] <= 1.8


def test_a_censored_last_value_is_kept_apart_as_a_bound():
    hist = HistoryFilter(host_groups(["a", "a", "b", "b"]))
    ok, everyone = torch.zeros(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool)
    for _ in range(5):
        hist.update(torch.zeros(4), ok, everyone)
    hist.update(
        torch.tensor([0.5, 1.0, 0.2, 1.0]), torch.tensor([False, True, False, True]), everyone
    )
    feats = hist.features()[2]
    exact, bound, host = feats[:, 3], feats[:, 4], feats[:, 6]
    assert exact[1] == 0 and exact[3] == 0 and bound[0] == 0 and bound[2] == 0
    assert bound[1] > 0.8 and exact[0] > 0.4  # the bound as it is, not an imputed value
    torch.testing.assert_close(host, torch.stack([exact[0], exact[0], exact[2], exact[2]]))


def _levels(levels, seed=0, iterations=6, workers=40):
    """Runs of the same relative run-times at different levels (seconds)."""
    rng = np.random.default_rng(seed)
    relative = np.exp(rng.normal(0.0, 0.2, (iterations, workers)))
    full = np.ones(relative.shape, dtype=bool)
    return [
        RunMatrix(f"r{i}", level * relative, ~full, full, tuple(f"h{w}" for w in range(workers)))
        for i, level in enumerate(levels)
    ]


def test_an_anchored_normalisation_sees_every_run_relative_to_its_first_iteration():
    runs = _levels([0.5, 1.0, 2.0, 4.0])
    norm = Normaliser.fit(runs, anchored=True)
    plain = Normaliser.fit(runs)
    first = np.median(np.log(runs[0].runtimes[0]))
    assert norm.anchored and np.isclose(norm.loc, first - np.log(0.5) + np.log(2.0) / 2)
    assert norm.scale < 0.5 * plain.scale  # the spread within runs, not between their levels
    # a new run's level given four fitted ones: Student's t, 3 degrees of freedom, scale the
    # anchors' sample sd times sqrt(1 + 1/4)
    anchors_sd = np.std(np.log([0.5, 1.0, 2.0, 4.0]), ddof=1)
    assert np.isclose(norm.level_sd * norm.scale, anchors_sd * np.sqrt(1.25))
    assert norm.level_dof == 3 and norm.at(0.0).level_dof == 0 == norm.at(0.0).level_sd
    idx = torch.arange(1, 41)
    ys = [to_tensors(r, norm, idx, idx).y for r in runs]
    assert abs(np.median(ys[0][0].numpy())) < 1e-5
    for y in ys[1:]:  # the same relative run-times: the same normalised values at every level
        torch.testing.assert_close(y, ys[0], atol=1e-4, rtol=0)
    far = to_tensors(runs[3], plain, idx, idx).y
    assert np.median(far[0].numpy()) > 1.0  # unanchored: the level is what the network sees


def test_subsample_hosts_keeps_whole_hosts_and_weighs_by_the_hosts_left_out():
    # 12 workers on 4 hosts of 3 (interleaved ids); about 6 workers a step: 2 of the 4 hosts
    hosts = [f"h{w % 4}" for w in range(12)]
    x, cens = np.full((30, 12), 0.05), np.zeros((30, 12), bool)
    run = RunMatrix("r", x, cens, np.ones_like(cens), tuple(hosts))
    data = to_tensors(run, Normaliser.fit([run]), torch.arange(1, 13), torch.arange(1, 13))
    batch = sample_windows([data], 10, 2, np.random.default_rng(0))
    seen = set()
    for seed in range(20):
        sub = subsample_hosts(batch, 6, np.random.default_rng(seed))
        kept = sub.worker_idx - 1  # the workers kept, in worker order
        assert sub.y.shape == (2, 10, 6) and sub.feats.shape[:3] == (2, 10, 6)
        assert sub.weight == 2.0 and kept.tolist() == sorted(kept.tolist())
        assert torch.equal(sub.y, batch.y[:, :, kept]) and torch.equal(sub.host_idx, kept + 1)
        on = {hosts[w] for w in kept.tolist()}
        assert len(on) == 2
        assert sum(hosts[w] in on for w in range(12)) == 6  # every worker of the hosts drawn
        assert sorted(set(sub.groups.tolist())) == [0, 1]  # renumbered among the hosts kept
        seen.add(frozenset(on))
    assert len(seen) > 3  # different hosts at different steps
    rng = np.random.default_rng(0)
    assert subsample_hosts(batch, 0, rng) is batch and subsample_hosts(batch, 12, rng) is batch
    assert rng.random() == np.random.default_rng(0).random()  # no draw taken when it is off


def test_the_regime_filter_reads_a_hosts_slow_spells_off_its_workers():
    """`harsh`-like hosts (4 workers each, slow spells 4x, entered at 2% and left at 10% an
    iteration): the filtered chance of a slow spell at the coming iteration is about 0.9 for a
    host slow at the last one and about 0.02 for a calm one, as the chain's transitions say."""
    cluster = SyntheticCluster(seed=3, hosts=8, slow_factor=4.0, p_slow=0.02, p_recover=0.1,
                               spike_p=0.03, drift=0.5, drift_period=300)  # fmt: skip
    terms = cluster.log_delays(400, 32)
    y = torch.as_tensor(terms.sum(0) / 0.7, dtype=torch.float32)  # (normalised-like)
    hist = HistoryFilter(host_groups(cluster.host_of(32)), NUM_FEATURES)
    slow = terms[2, :, :8] > 0  # (workers 0-7: one per host)
    chance, was_slow = [], []
    for t in range(400):
        if t > 20:
            chance.append(hist.features()[2][:8, -1].numpy().copy())
            was_slow.append(slow[t - 1])
        hist.update(y[t], torch.zeros(32, dtype=torch.bool), torch.ones(32, dtype=torch.bool))
    chance, was_slow = np.array(chance), np.array(was_slow)
    assert was_slow.sum() > 100 and (~was_slow).sum() > 1000
    assert 0.85 < chance[was_slow].mean() <= 0.9 and chance[~was_slow].mean() < 0.04


def test_a_calm_hosts_noise_hardly_moves_the_expected_location():
    """Four workers on one calm host, noise only: the host's chance of a slow spell stays low,
    so the expected location moves no more than the slow EWMA does (no host average of recent
    values in it); one iteration slower by 2 is then read as a slow spell."""
    rng = np.random.default_rng(0)
    hist = HistoryFilter(torch.zeros(4, dtype=torch.long), NUM_FEATURES)
    ok, present = torch.zeros(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool)
    for _ in range(200):
        hist.update(torch.as_tensor(rng.normal(0.0, 0.3, 4), dtype=torch.float32), ok, present)
    expected, slow, chance = [], [], []
    for _ in range(100):
        feats = hist.features()[2]
        expected.append(feats[:, -2] + hist.slow)
        slow.append(hist.slow.clone())
        chance.append(float(feats[0, -1]))
        hist.update(torch.as_tensor(rng.normal(0.0, 0.3, 4), dtype=torch.float32), ok, present)
    assert max(chance) < 0.1
    assert torch.all(torch.stack(expected).std(0) <= 1.05 * torch.stack(slow).std(0))
    hist.update(torch.full((4,), 2.0), ok, present)
    assert hist.features()[2][0, -1] > 0.8
