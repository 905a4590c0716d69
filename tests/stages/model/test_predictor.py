"""The per-iteration predictor: shapes, censoring/missing inputs, unknown workers, seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.model.checkpoint import Checkpoint, Vocab, save_checkpoint
from bdsgd.stages.model.data import Normaliser
from bdsgd.stages.model.predictor import (
    LEVEL_T_CLIP,
    Arrivals,
    float32_at_least,
    load_predictor,
    log_ndtr32,
    ndtri_exp32,
)
from bdsgd.stages.model.runtime_model import ModelConfig, RuntimeModel
from scipy.special import log_ndtr, ndtri_exp


@pytest.fixture
def checkpoint_path(tmp_path):
    torch.manual_seed(0)
    model = RuntimeModel(ModelConfig(num_workers=3, num_hosts=2, z_dim=4, hidden=16))
    vocab = Vocab((0, 1, 2), ("a", "b"), {0: "a", 1: "b", 2: "a"})
    ckpt = Checkpoint(model, Normaliser(np.log(0.05), 0.3), vocab, ("a", "b", "a"), {}, {})
    return save_checkpoint(tmp_path / "m.pt", ckpt)


def test_samples_are_positive_joint_draws_for_the_default_workers(checkpoint_path):
    pred = load_predictor(checkpoint_path, seed=0)
    pred.observe(np.array([0.05, 0.06, 0.04]), np.array([False, False, False]))
    x = pred.sample(128)
    assert x.shape == (128, 3) and x.dtype == torch.float32
    assert torch.all(x > 0) and torch.isfinite(x).all()
    assert 0.005 < float(x.median()) < 0.5


def test_unknown_workers_and_hosts_use_the_unknown_embedding(checkpoint_path):
    pred = load_predictor(checkpoint_path, workers=[0, 7, 8, 2], hosts=["a", "a", "new-host", "b"])
    assert pred.sample(4).shape == (4, 4)
    assert pred.params.emb.shape[0] == 4
    by_default = load_predictor(checkpoint_path, workers=[5])
    assert by_default.sample(2).shape == (2, 1)
    with pytest.raises(ConfigError, match=r"one host per worker .*\(got 2 workers, 1 hosts\)"):
        load_predictor(checkpoint_path, workers=[0, 1], hosts=["a"])


def test_an_iteration_of_the_wrong_size_is_a_clear_error(checkpoint_path):
    pred = load_predictor(checkpoint_path)
    with pytest.raises(ConfigError, match="predictor for 3 workers"):
        pred.observe(np.array([0.05, 0.06]), np.zeros(2, dtype=bool))


def test_censored_and_missing_entries_are_accepted(checkpoint_path):
    pred = load_predictor(checkpoint_path)
    for _ in range(5):
        pred.observe(np.array([0.05, np.nan, 0.09]), np.array([False, False, True]))
    ll, scored = pred.log_predictive(np.array([0.05, np.nan, 0.2]), np.array([False, False, True]))
    assert scored == 2 and np.isfinite(ll)
    assert torch.isfinite(pred.sample(8)).all()


def test_same_seed_same_samples(checkpoint_path):
    draws = []
    for _ in range(2):
        pred = load_predictor(checkpoint_path, seed=11)
        pred.observe(np.array([0.05, 0.06, 0.04]), np.zeros(3, dtype=bool))
        draws.append(pred.sample(32))
    torch.testing.assert_close(draws[0], draws[1])


def host_pair_predictor(tmp_path, interleaved: bool = False, drops: bool = False):
    """4 workers, hosts a, a, b, b; a host slows down as a whole (jump 3 normalised units) with
    probability about 1/2 per iteration, so a host mate's run-time says much about a worker's.
    ``drops``: a host also drops as a whole by 3 units, each of the three states about 1/3."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_workers=4, num_hosts=2, z_dim=4, hidden=16, recovery=drops)
    model = RuntimeModel(cfg)
    tail = sum(model.head.sizes[:6])  # the head's outputs: ..., tail (6), jump weights
    with torch.no_grad():
        model.head.mlp[2].bias[tail + 4] = 2.5  # jump size softplus(2.5 + 0.54) ~ 3
        model.head.mlp[2].bias[tail + 5] = 5.0  # jump logit bias ~ 0
        if drops:  # the drop's outputs: logit bias, its weights (F), size bias, its weights
            model.head.recovery.bias[0] = 5.0  # drop logit bias ~ 0
            model.head.recovery.bias[1 + model.cfg.num_features] = 2.5  # size ~ 3
    vocab = Vocab((0, 1, 2, 3), ("a", "b"), {0: "a", 1: "a", 2: "b", 3: "b"})
    ckpt = Checkpoint(model, Normaliser(np.log(0.05), 0.3), vocab, ("a", "a", "b", "b"), {}, {})
    path = save_checkpoint(tmp_path / "m.pt", ckpt)
    if interleaved:  # the same workers listed as a, b, a, b
        pred = load_predictor(path, [0, 2, 1, 3], ["a", "b", "a", "b"], seed=0)
    else:
        pred = load_predictor(path, seed=0)
    for _ in range(20):
        pred.observe(np.full(4, 0.05), np.zeros(4, dtype=bool))
    return pred


def test_remaining_draws_the_waiting_workers_above_the_present(tmp_path):
    pred = host_pair_predictor(tmp_path)
    pred.sample(256)
    arrived = np.array([True, False, True, False])
    draws = pred.remaining(0.06, np.array([0.05, 0, 0.055, 0]), arrived, ~arrived)
    assert draws.shape == (256, 2) and np.isfinite(draws).all() and np.all(draws > 0.06)


def test_workers_late_together_predict_their_host_slowed_down(tmp_path):
    # at the same moment, with two workers still out: both of host a (a slow spell of the
    # host explains it) or one per host, each with a host mate that arrived on time
    pred = host_pair_predictor(tmp_path)
    now = 0.05 * np.exp(0.3 * 1.0)  # 5 spreads above the usual run-time
    medians = {}
    for name, out in {"same host": [0, 1], "one per host": [1, 2]}.items():
        waiting = np.isin(np.arange(4), out)
        pred.sample(1024)
        draws = pred.remaining(now, np.where(waiting, 0.0, 0.05), ~waiting, waiting)
        medians[name] = float(np.median(draws[:, 0]))  # worker 1 in both cases
    # same host: worker 1 is predicted near the jumped level exp(0.3 * 3.1) * 0.05;
    # one per host: just above the present
    assert medians["same host"] > 1.4 * medians["one per host"]
    assert medians["one per host"] > now


def test_a_host_mate_in_far_early_predicts_its_host_dropped(tmp_path):
    # worker 1 (host a) still out just after a host's dropped level: its mate 0 came in at that
    # level (host a dropped: 1 is due now), or host b's worker 2 did (nothing said of host a)
    pred = host_pair_predictor(tmp_path, drops=True)
    dropped = 0.05 * np.exp(-0.3 * 3.1)
    now = dropped * 1.05
    medians = {}
    for name, came in {"mate dropped": 0, "other host dropped": 2}.items():
        arrived = np.arange(4) == came
        pred.sample(1024)
        draws = pred.remaining(now, np.where(arrived, dropped, 0.0), arrived, ~arrived)
        medians[name] = float(np.median(draws[:, 0]))  # worker 1 in both cases
    assert pred._arrivals.num_states == 3
    assert medians["other host dropped"] > 1.5 * medians["mate dropped"]
    assert medians["mate dropped"] > now


def test_remaining_needs_a_sample_first(tmp_path):
    pred = host_pair_predictor(tmp_path)
    with pytest.raises(RuntimeError, match="sample"):
        pred.remaining(0.05, np.zeros(4), np.zeros(4, bool), np.ones(4, bool))


def test_host_mates_still_out_slow_down_together_within_a_draw(tmp_path):
    # host a's two workers are out at a usual moment: a slow spell of host a (prior about 1/2)
    # becomes likelier, about 0.5 / (0.5 + 0.5 / 4) = 0.8 (each is out half the time in a calm
    # spell), but not certain; and when a draw has it, both of its workers are slow in that draw,
    # not one of them at random
    pred = host_pair_predictor(tmp_path)
    pred.sample(2048)
    waiting = np.array([True, True, False, False])
    draws = np.log(pred.remaining(0.05, np.where(waiting, 0.0, 0.05), ~waiting, waiting))
    slow = draws > np.log(0.05) + 0.3 * 1.5  # half way to the jumped level
    assert 0.6 < slow[:, 0].mean() < 0.95
    assert np.mean(slow[:, 0] == slow[:, 1]) > 0.95
    assert np.all(draws > np.log(0.05))


def test_remaining_stays_above_the_present_far_in_the_tail(tmp_path):
    pred = host_pair_predictor(tmp_path)
    pred.sample(256)
    arrived = np.array([True, False, True, True])
    now = 0.05 * np.exp(0.3 * 60)  # 60 normalised units: every component's survival underflows
    draws = pred.remaining(now, np.where(arrived, 0.05, 0.0), arrived, ~arrived)
    assert np.isfinite(draws).all() and np.all(draws >= now)


def test_arrivals_sum_only_new_arrivals_and_match_a_fresh_start(tmp_path):
    # within an iteration arrivals only grow: the kept per-host sums must equal a fresh start's,
    # and a set that is not a superset (a new iteration's) starts afresh
    pred = host_pair_predictor(tmp_path)
    pred.sample(64)
    x = np.array([0.05, 0.0, 0.055, 0.06])
    order = [np.array([True, False, False, False]), np.array([True, False, True, True])]
    for arrived in order:
        pred.remaining(0.061, np.where(arrived, x, 0.0), arrived, ~arrived)
    kept = [getattr(pred._arrivals, k).copy() for k in ("seen_arrived", "mixed", "mixed_sum")]
    pred._arrivals.added = None  # forget: sum every arrival at once
    pred.remaining(0.061, np.where(order[1], x, 0.0), order[1], ~order[1])
    arrivals = pred._arrivals
    np.testing.assert_allclose(kept[0], arrivals.seen_arrived)
    # each host's term with its jump summed out, and their sum, as computed from the sums afresh
    assert arrivals.seen_arrived.shape[1] == arrivals.log_states.shape[0] == 2  # calm, jumped
    fresh = np.logaddexp.reduce(arrivals.seen_arrived + arrivals.log_states, axis=1)
    np.testing.assert_allclose(kept[1], fresh, atol=1e-9)
    np.testing.assert_allclose(kept[2], fresh.sum(-1), atol=1e-9)
    assert np.abs(kept[2]).min() > 0.1  # the arrivals moved it (0 before any)
    fewer = np.array([False, False, True, False])
    draws = pred.remaining(0.06, np.where(fewer, x, 0.0), fewer, ~fewer)
    assert pred._arrivals.added.tolist() == fewer.tolist() and draws.shape == (64, 3)


def test_remaining_keeps_the_waiting_workers_in_index_order(tmp_path):
    # the draws are computed host by host; the columns must come back in the workers' order.
    # Hosts a, b, a, b: positions 1 and 3 (host b) are both late, so host b is likely slow;
    # position 2 (host a) is late while its host mate arrived on time
    pred = host_pair_predictor(tmp_path, interleaved=True)
    pred.sample(2048)
    waiting = np.array([False, True, True, True])
    now = 0.05 * np.exp(0.3 * 1.0)
    draws = pred.remaining(now, np.where(waiting, 0.0, 0.05), ~waiting, waiting)
    medians = np.median(draws, axis=0)  # positions 1, 2, 3
    assert medians[0] > 1.3 * medians[1] and medians[2] > 1.3 * medians[1]
    assert not pred._arrivals.in_worker_order  # the columns went back through the scatter


def test_workers_listed_host_by_host_skip_the_scatter_and_draw_the_same(tmp_path):
    pred = host_pair_predictor(tmp_path)  # hosts a, a, b, b: by host is by worker id
    pred.sample(64)
    waiting = np.array([False, True, False, True])
    x = np.where(waiting, 0.0, 0.05)
    pred.remaining(0.055, x, ~waiting, waiting)
    arrivals, draws = pred._arrivals, []
    assert arrivals.in_worker_order
    for shortcut in (True, False):
        arrivals.in_worker_order, arrivals.rng = shortcut, np.random.default_rng(5)
        draws.append(pred.remaining(0.06, x, ~waiting, waiting))
    np.testing.assert_array_equal(draws[0], draws[1])


def _anchored_checkpoint(tmp_path, level_sd=0.0, level_dof=0):
    torch.manual_seed(0)
    model = RuntimeModel(ModelConfig(num_workers=4, num_hosts=4, z_dim=4, hidden=16))
    vocab = Vocab((0, 1, 2, 3), ("a", "b", "c", "d"), {0: "a", 1: "b", 2: "c", 3: "d"})
    norm = Normaliser(np.log(1.0), 0.3, anchored=True, level_sd=level_sd, level_dof=level_dof)
    ckpt = Checkpoint(model, norm, vocab, ("a", "b", "c", "d"), {}, {})
    return save_checkpoint(tmp_path / "m.pt", ckpt)


def test_an_anchored_predictor_scales_with_the_level_its_run_showed(tmp_path):
    path = _anchored_checkpoint(tmp_path)
    rng = np.random.default_rng(0)
    relative = np.exp(rng.normal(0.0, 0.1, (5, 4)))
    draws = {}
    for level in (0.2, 1.0, 7.0):  # below, at and far above the level the model was fitted at
        pred = load_predictor(path, seed=3)
        for x in relative:
            pred.observe(level * x, np.zeros(4, dtype=bool))
        draws[level] = pred.sample(256).numpy().astype(float)
        assert pred.remaining(0.5 * level, level * relative[0], np.eye(4, dtype=bool)[0],
                              ~np.eye(4, dtype=bool)[0]).min() > 0.5 * level  # fmt: skip
    np.testing.assert_allclose(draws[0.2] / 0.2, draws[1.0], rtol=1e-3)
    np.testing.assert_allclose(draws[7.0] / 7.0, draws[1.0], rtol=1e-3)


def test_before_its_first_iteration_a_run_level_is_drawn_with_the_fitted_levels_spread(tmp_path):
    def level_spread(level_sd):
        pred = load_predictor(_anchored_checkpoint(tmp_path, level_sd), seed=1)
        before = np.log(pred.sample(512).numpy()).mean(axis=1).std()
        pred.observe(np.full(4, 3.0), np.zeros(4, dtype=bool))
        return before, np.log(pred.sample(512).numpy()).mean(axis=1).std()

    tight, tight_after = level_spread(0.0)
    wide, wide_after = level_spread(2.0)
    assert wide > tight + 0.4 and np.isclose(wide**2 - tight**2, (2.0 * 0.3) ** 2, rtol=0.3)
    assert abs(wide_after - tight_after) < 0.05  # anchored: the level is known


def test_with_few_fitted_runs_a_new_runs_level_is_drawn_from_a_students_t(tmp_path):
    """level_dof = 3 (four fitted runs): the first iteration's draws put far more of their
    levels beyond 2.5 level_sd than a normal does (t_3: 8.8%, normal: 1.2%), none beyond the
    clip, and the checkpoint keeps the degrees of freedom."""

    def levels(level_dof):
        pred = load_predictor(_anchored_checkpoint(tmp_path, 1.0, level_dof), seed=1)
        assert pred.norm.level_dof == level_dof
        level = np.log(pred.sample(4096).numpy()).mean(axis=1)
        return np.abs(level - np.median(level)) / 0.3  # in level_sd (1.0 normalised)

    normal, t3 = levels(0), levels(3)
    assert np.mean(normal > 2.5) < 0.03 and np.mean(t3 > 2.5) > 0.05
    assert t3.max() < LEVEL_T_CLIP + 1.0


def test_the_float32_normal_tails_agree_with_scipys_float64():
    z = np.linspace(-40.0, 8.0, 20_001).astype(np.float32)
    want = log_ndtr(z.astype(np.float64))
    np.testing.assert_allclose(log_ndtr32(z), want, rtol=1e-5, atol=2e-5)
    log_p = np.concatenate([np.linspace(-700.0, -1.0, 10_001), -np.logspace(0, -7, 10_001)])
    log_p = log_p.astype(np.float32)
    want = ndtri_exp(log_p.astype(np.float64))
    np.testing.assert_allclose(ndtri_exp32(log_p), want, rtol=1e-5, atol=2e-5)


def test_the_conditional_groups_a_mask_of_workers_by_host_in_worker_order(checkpoint_path):
    hosts = ["h3", "h1", "h3", "h2", "h1", "h1", "h4", "h3", "h2"]
    pred = load_predictor(checkpoint_path, workers=list(range(9)), hosts=hosts, seed=0)
    pred.sample(16)
    pred.remaining(0.06, np.zeros(9), np.zeros(9, bool), np.ones(9, bool))
    arrivals, groups = pred._arrivals, pred.host_index.groups.numpy()
    for mask in np.random.default_rng(0).random((20, 9)) < 0.6:
        w, on, starts, where = arrivals.grouped(mask)
        expected = np.flatnonzero(mask)[np.argsort(groups[mask], kind="stable")]
        assert w.tolist() == expected.tolist()  # by host, by worker id within a host
        assert on.tolist() == sorted(set(groups[mask].tolist()))
        assert groups[w[starts]].tolist() == on.tolist() and (on[where] == groups[w]).all()


def test_a_draw_whose_host_term_is_minus_infinity_gets_no_weight_not_nan(tmp_path):
    # a host's kept term at -inf (its arrivals impossible under that draw of z): the kept sum
    # minus that term would be (-inf) - (-inf); the other hosts are summed afresh instead
    pred = host_pair_predictor(tmp_path)
    pred.sample(64)
    arrived = np.array([True, False, True, False])  # one worker of each host waited on
    x = np.where(arrived, 0.05, 0.0)
    pred.remaining(0.051, x, arrived, ~arrived)
    arrivals = pred._arrivals
    arrivals.seen_arrived[0] = -np.inf  # draw 0: every host's arrivals impossible
    arrivals.mixed[0] = -np.inf
    arrivals.mixed_sum[0] = -np.inf
    weighed, pick = [], arrivals.pick_draws
    arrivals.pick_draws = lambda joint: weighed.append(joint.copy()) or pick(joint)
    with np.errstate(invalid="ignore"):  # draw 0's jump odds are nan: it is never picked
        draws = pred.remaining(0.052, x, arrived, ~arrived)
    assert np.isneginf(weighed[0][0]) and np.isfinite(weighed[0][1:]).all()
    assert draws.shape == (64, 2) and np.isfinite(draws).all() and np.all(draws > 0.052)


@pytest.mark.parametrize("value", [0.06, 0.7, 2.3, 1e-7, 0.5, 123.456])
def test_float32_at_least_is_the_least_float32_not_below_the_value(value):
    got = float32_at_least(value)
    assert got.dtype == np.float32 and float(got) >= value
    assert float(np.nextafter(got, np.float32(0.0))) < value


def test_arrivals_one_at_a_time_on_interleaved_hosts_match_a_fresh_start(tmp_path):
    # a single new arrival takes the short path (its host looked up directly, no grouping):
    # with hosts a, b, a, b the sums must equal those of every arrival grouped at once
    pred = host_pair_predictor(tmp_path, interleaved=True)
    pred.sample(64)
    x = np.array([0.05, 0.07, 0.055, 0.06])
    arrived = np.zeros(4, dtype=bool)
    for w in (1, 0, 3):  # one arrival per revision: hosts b, a, b
        arrived[w] = True
        pred.remaining(0.07, np.where(arrived, x, 0.0), arrived.copy(), ~arrived)
    kept = [getattr(pred._arrivals, k).copy() for k in ("seen_arrived", "mixed", "mixed_sum")]
    pred._arrivals.added = None  # forget: all three at once, grouped by host
    pred.remaining(0.07, np.where(arrived, x, 0.0), arrived.copy(), ~arrived)
    for before, name in zip(kept, ("seen_arrived", "mixed", "mixed_sum"), strict=True):
        np.testing.assert_allclose(before, getattr(pred._arrivals, name), rtol=1e-12, atol=1e-9)
    assert not np.allclose(kept[0][:, :, 0], kept[0][:, :, 1])  # the hosts' sums differ


def test_the_online_shift_moves_every_draw_by_its_factor(checkpoint_path):
    draws = []
    for shift in (0.0, 0.2):
        pred = load_predictor(checkpoint_path, seed=11)
        pred.observe(np.array([0.05, 0.06, 0.04]), np.zeros(3, dtype=bool))
        pred.online.log_shift = shift
        draws.append(pred.sample(32))
    torch.testing.assert_close(draws[1], draws[0] * np.exp(0.2), rtol=1e-5, atol=0.0)


def test_the_three_state_host_draw_follows_each_picked_draws_posterior():
    """``Arrivals.draw_hosts`` with host drops (calm, jumped, dropped): each sample's host
    states are drawn from the posterior of the draw of z it picked. Two draws of equal weight,
    two hosts waited on, each with its own known state probabilities."""
    probs = np.array([[[0.6, 0.1], [0.3, 0.1], [0.1, 0.8]],  # draw 0: (K states, hosts)
                      [[0.1, 0.2], [0.1, 0.7], [0.8, 0.1]]])  # draw 1  # fmt: skip
    arr = object.__new__(Arrivals)
    arr.rng = np.random.default_rng(0)
    arr.num_samples, arr.num_states, arr.num_hosts = 20_000, 3, 2
    arr.log_states = np.zeros((3, 2))
    arr.mixed, arr.mixed_sum = np.zeros((2, 2)), np.zeros(2)
    arr.arrived_terms = lambda y, arrived: np.log(probs)  # (P, K, hosts): normalised per host
    out = np.zeros((2, 2, 3))  # (P, waiting workers, K): nothing said by who is still out
    pick, state = arr.draw_hosts(None, None, np.array([0, 1]), np.array([0, 1]), out)
    assert state.shape == (20_000, 2) and set(np.unique(state)) <= {0, 1, 2}
    for p in (0, 1):
        mine = state[pick == p]
        assert abs(len(mine) / 20_000 - 0.5) < 0.02  # equal weights: picked half the time each
        for h in (0, 1):
            share = np.bincount(mine[:, h], minlength=3) / len(mine)
            sd = np.sqrt(probs[p, :, h] * (1 - probs[p, :, h]) / len(mine))
            assert np.all(np.abs(share - probs[p, :, h]) < 5 * sd + 1e-9), (p, h, share)
