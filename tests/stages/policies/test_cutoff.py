"""Sync cutoff policies: the shared objective and each policy's choice on hand-made cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.policies.cutoff import (
    BdsgdCutoff,
    EcdfCutoff,
    ElfvingCutoff,
    EwmaCutoff,
    FullSync,
    OracleCutoff,
    RateTracker,
    StaticCutoff,
    best_cutoff,
    cut_terms,
)

ALL = np.ones(4, dtype=bool)


class FixedPredictor:
    """A Predictor test double: always the same (S, N) samples; records what it observed."""

    def __init__(self, samples: np.ndarray) -> None:
        self.samples = torch.as_tensor(samples, dtype=torch.float64)
        self.seen: list[tuple[np.ndarray, np.ndarray]] = []

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.seen.append((runtimes, censored))

    def sample(self, num_samples: int) -> torch.Tensor:
        return self.samples[:num_samples]


def test_best_cutoff_trades_gradients_for_time():
    # 3 fast workers then a straggler: c=3 gives 3/1.2 = 2.5/s, c=4 gives 4/10
    assert best_cutoff(np.array([1.0, 1.1, 1.2, 10.0]), overhead_s=0.0) == 3
    # equal run-times: waiting for everyone is free
    assert best_cutoff(np.full(4, 1.0), overhead_s=0.0) == 4


def test_overhead_makes_waiting_for_more_worthwhile():
    expected = np.array([1.0, 2.0, 3.0, 4.0])
    assert (
        best_cutoff(expected, overhead_s=0.0) == 4
    )  # c / c = 1 for every c: ties go to the larger c
    assert best_cutoff(np.array([1.0, 2.5, 4.0, 6.0]), overhead_s=0.0) == 1
    assert best_cutoff(np.array([1.0, 2.5, 4.0, 6.0]), overhead_s=10.0) == 4


def test_full_and_static_cap_to_live_workers():
    live = np.array([True, False, True, True])
    assert FullSync().choose(live) == 3
    assert StaticCutoff(2).choose(live) == 2
    assert StaticCutoff(4).choose(live) == 3
    with pytest.raises(ConfigError, match="static:C needs C >= 1, got 0"):
        StaticCutoff(0)


def test_oracle_cuts_at_the_true_straggler():
    oracle = OracleCutoff()
    oracle.reveal(np.array([1.0, 9.0, 1.1, 1.2]))
    assert oracle.choose(ALL) == 3
    oracle.reveal(np.array([1.0, 9.0, 1.1, 1.2]))
    assert oracle.choose(np.array([True, False, True, True])) == 3


def test_elfving_waits_for_everyone_on_a_tight_gaussian():
    policy = ElfvingCutoff(window=10)
    assert policy.choose(ALL) == 4  # no data yet
    for _ in range(10):
        policy.observe(np.array([1.0, 1.01, 0.99, 1.0]), np.zeros(4, dtype=bool))
    assert policy.choose(ALL) == 4


def test_elfving_drops_some_when_spread_is_wide():
    policy = ElfvingCutoff(window=10)
    for _ in range(10):
        policy.observe(np.array([1.0, 1.0, 1.0, 6.0]), np.zeros(4, dtype=bool))
    assert policy.choose(ALL) < 4


def test_ecdf_drops_the_straggler_share():
    policy = EcdfCutoff(window=20, num_samples=512, seed=0)
    for _ in range(20):  # one worker in ten is 20x slower
        policy.observe(np.r_[np.ones(9), 20.0], np.zeros(10, dtype=bool))
    c = policy.choose(np.ones(10, dtype=bool))
    assert 5 <= c <= 9


def test_ewma_knows_which_worker_is_slow():
    policy = EwmaCutoff(4, num_samples=128, seed=0)
    assert policy.choose(ALL) == 4  # no data yet
    for _ in range(30):
        policy.observe(np.array([1.0, 1.0, 1.0, 5.0]), np.zeros(4, dtype=bool))
    assert policy.choose(ALL) == 3
    # the slow worker died: the rest are equal, wait for all of them
    assert policy.choose(np.array([True, True, True, False])) == 3


def test_a_cut_worker_finishes_the_micro_batch_it_is_in():
    """Three workers near 0.16 s, one at 0.4 s, 4 micro-batches each: cut at the first arrival
    (0.15), the two fast ones finish their last micro-batch (a whole gradient each) and the slow
    one its second (half), which ends the iteration at 0.2 s, as a cut at the third does."""
    ordered = np.array([[0.15, 0.16, 0.17, 0.4]])
    extra, length = cut_terms(ordered, 4)
    assert extra.tolist() == pytest.approx([2.5, 1.5, 0.5, 0.0])
    assert length.tolist() == pytest.approx([0.2, 0.2, 0.2, 0.4])
    assert cut_terms(ordered, 4, now=0.155) == pytest.approx((3.5, 0.2))


def test_under_salvage_a_cut_gives_up_little_and_a_slow_worker_is_cut():
    """Four steady workers: whatever c it picks, the cut ones (in their last parts) salvage
    nearly all they would have given; one worker 5x slower is cut, salvaging its first part."""
    steady = EwmaCutoff(4, num_samples=256, seed=0)
    steady.salvage_parts = 4
    for _ in range(30):
        steady.observe(np.array([1.0, 1.0, 1.0, 1.05]), np.zeros(4, dtype=bool))
    c = steady.choose(ALL)
    assert steady.worth_of_count()(c) > 3.8
    slow = EwmaCutoff(4, num_samples=256, seed=0)
    slow.salvage_parts = 4
    for _ in range(30):
        slow.observe(np.array([1.0, 1.0, 1.0, 5.0]), np.zeros(4, dtype=bool))
    c = slow.choose(ALL)
    assert c < 4  # the slow one is cut, in its first part; the fast ones finish theirs
    assert 3.1 < slow.worth_of_count()(c) < 3.5


def test_bdsgd_uses_the_predictive_and_reports_quantiles():
    rng = np.random.default_rng(0)
    samples = np.c_[rng.uniform(0.9, 1.1, (256, 3)), rng.uniform(4.0, 6.0, (256, 1))]
    predictor = FixedPredictor(samples)
    policy = BdsgdCutoff(predictor, num_samples=256)
    policy.overhead_s = 0.5
    assert policy.choose(ALL) == 3
    q = policy.describe()
    assert 1.4 < q["pred_q10"] < q["pred_q50"] < q["pred_q90"] < 1.6  # x_(3) + overhead
    # with only the slow worker and one fast one live, it waits for the fast one alone
    assert policy.choose(np.array([True, False, False, True])) == 1


def test_bdsgd_passes_observations_through():
    predictor = FixedPredictor(np.ones((4, 4)))
    policy = BdsgdCutoff(predictor, num_samples=4)
    x, cens = np.array([1.0, 2.0, 3.0, 3.0]), np.array([False, False, False, True])
    policy.observe(x, cens)
    assert predictor.seen[0][0] is x and predictor.seen[0][1] is cens


def test_long_run_objective_pays_each_gradient_at_the_going_rate():
    expected = np.array([1.0, 2.0, 2.2, 10.0])
    assert best_cutoff(expected, overhead_s=0.0) == 3  # per iteration: 3 / 2.2 is the best rate
    # at 2 gradients/s a second costs 2 gradients: c=1 nets 1 - 2, c=3 nets 3 - 4.4
    assert best_cutoff(expected, overhead_s=0.0, rate=2.0) == 1
    assert best_cutoff(expected, overhead_s=0.0, rate=0.5) == 3
    assert best_cutoff(expected, overhead_s=0.0, rate=None) == 3


def test_rate_tracker_follows_the_achieved_throughput():
    tracker = RateTracker(alpha=0.1)
    assert tracker.rate() is None
    for _ in range(50):  # 3 gradients accepted in 2 s (+ 0.5 s overhead)
        tracker.observe(np.array([1.0, 2.0, 2.0, 2.0]), np.array([0, 0, 1, 0], bool), 0.5)
    assert tracker.rate() == pytest.approx(3 / 2.5)
    tracker.observe(np.ones(4), np.ones(4, dtype=bool), 0.5)  # nothing accepted: no update
    assert tracker.rate() == pytest.approx(3 / 2.5)


class ReplayPredictor:
    """A Predictor test double that knows the next row of a run (a perfect predictive)."""

    def __init__(self, runtimes: np.ndarray) -> None:
        self.runtimes, self.t = runtimes, 0

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.t += 1

    def sample(self, num_samples: int) -> torch.Tensor:
        return torch.as_tensor(self.runtimes[self.t]).expand(num_samples, -1)


def test_long_run_objective_beats_the_per_iteration_rate_across_regimes():
    from bdsgd.stages.simulate import simulate_sync
    from bdsgd.stages.store import RunMatrix

    fast = np.array([1.0, 1.0, 1.0, 1.0])
    slow = np.array([5.0, 9.9, 14.7, 19.5])  # per iteration, waiting for all is (just) best
    runtimes = np.stack([fast if t % 2 else slow for t in range(200)])
    mask = np.ones_like(runtimes, dtype=bool)
    run = RunMatrix("r", runtimes, ~mask, mask, ("h",) * 4)
    throughput = {}
    for objective in ("iteration", "long-run"):
        policy = BdsgdCutoff(ReplayPredictor(runtimes), num_samples=2, objective=objective)
        result = simulate_sync(policy, run, 0, overhead_s=0.0)
        c, seconds = np.array(result.columns["c"]), np.array(result.columns["iteration_s"])
        throughput[objective] = c.sum() / seconds.sum()
    # iteration: 4 gradients per 1 s, then 4 per 19.5 s; long run: the slow row's first alone
    assert throughput["iteration"] == pytest.approx(8 / 20.5, rel=0.02)
    assert throughput["long-run"] > 1.9 * throughput["iteration"]


def test_objective_is_validated_and_named():
    with pytest.raises(ConfigError, match="objective must be one of .*got 'fastest'"):
        EwmaCutoff(4, objective="fastest")
    assert EwmaCutoff(4).name == "ewma"
    assert EwmaCutoff(4, objective="iteration").name == "ewma:iteration"


def test_history_the_policy_did_not_choose_teaches_the_predictor_but_not_the_rate():
    # a full-sync profile (every worker awaited, slowest at 10 s) replayed as warm-up
    predictor = FixedPredictor(np.tile([1.0, 1.1, 1.2, 10.0], (8, 1)))
    policy = BdsgdCutoff(predictor, num_samples=8)
    for _ in range(20):
        policy.observe(np.array([1.0, 1.1, 1.2, 10.0]), np.zeros(4, dtype=bool))
    assert len(predictor.seen) == 20
    assert policy.tracker.rate() is None  # 4 gradients per 10 s is full sync's rate, not ours
    assert policy.choose(ALL) == 3  # so the first choice is the per-iteration best
    policy.observe(np.array([1.0, 1.1, 1.2, 1.2]), np.array([0, 0, 0, 1], bool))
    assert policy.tracker.rate() == pytest.approx(3 / 1.2)


def test_going_rate_never_exceeds_what_the_predictive_offers():
    # a pessimistic predictive (every run-time twice the truth): the achieved rate is above any
    # rate it offers, so c - lambda * E[x_(c)] < 0 for every c and, uncapped, c would collapse
    runtimes = np.array([1.0, 1.1, 1.2, 1.3])
    policy = BdsgdCutoff(FixedPredictor(np.tile(2 * runtimes, (8, 1))), num_samples=8)
    for _ in range(50):
        c = policy.choose(ALL)
        policy.observe(np.minimum(runtimes, runtimes[c - 1]), np.arange(4) >= c)
    assert policy.tracker.rate() == pytest.approx(4 / 1.3, rel=0.01)
    assert policy.going_rate(2 * runtimes) == pytest.approx(4 / 2.6, rel=0.01)


class ArrivalPredictor(FixedPredictor):
    """A FixedPredictor that also conditions on arrivals: the waiting workers' run-times are
    ``now_s`` plus ``extra`` (one row of extra seconds per waiting worker); records each call."""

    def __init__(self, samples: np.ndarray, extra: float) -> None:
        super().__init__(samples)
        self.extra = extra
        self.calls: list[tuple[float, int, int]] = []

    def remaining(self, now_s, runtimes, arrived, waiting) -> np.ndarray:
        self.calls.append((now_s, int(arrived.sum()), int(waiting.sum())))
        later = now_s + self.extra * np.arange(1, int(waiting.sum()) + 1)
        return np.tile(later, (4, 1))


def online_bdsgd(extra: float) -> tuple[BdsgdCutoff, ArrivalPredictor]:
    predictor = ArrivalPredictor(np.tile([1.0, 1.1, 1.2, 10.0], (4, 1)), extra)
    policy = BdsgdCutoff(predictor, num_samples=4, objective="iteration")
    assert policy.online and policy.name == "bdsgd:iteration"
    assert policy.choose(ALL) == 3  # before the iteration: the straggler is not worth it
    return policy, predictor


def arrivals(k: int, runtimes=(1.0, 1.1, 1.2, 10.0)) -> tuple[float, np.ndarray, np.ndarray]:
    """(now, runtimes, arrived) at the k-th arrival of an iteration with these run-times."""
    arrived = np.zeros(4, dtype=bool)
    arrived[np.argsort(runtimes)[:k]] = True
    return float(np.sort(runtimes)[k - 1]), np.where(arrived, runtimes, 0.0), arrived


def test_online_bdsgd_stops_early_when_the_rest_look_slow():
    # at the 1st arrival (1 s), the model says the others need 10 s more each: 1/1 s beats any
    # later arrival, so the iteration ends now although choose() said 3
    policy, predictor = online_bdsgd(extra=10.0)
    assert policy.revise(*arrivals(1)) == 1
    assert predictor.calls == [(1.0, 1, 3)]


def test_online_bdsgd_waits_beyond_its_c_when_the_rest_are_about_to_arrive():
    # at the 3rd arrival (1.2 s) the last worker is predicted 0.01 s away: 4/1.21 > 3/1.2
    policy, _ = online_bdsgd(extra=0.01)
    assert policy.revise(*arrivals(3)) == 4
    # and at the 2nd arrival it keeps waiting (returns a target above 2)
    assert policy.revise(*arrivals(2)) > 2


def test_fixed_stopping_and_predictors_without_remaining_keep_the_chosen_c():
    policy = BdsgdCutoff(FixedPredictor(np.tile([1.0, 1.1, 1.2, 10.0], (4, 1))), num_samples=4)
    assert policy.online and policy.choose(ALL) == 3
    assert policy.revise(*arrivals(1)) == 3  # nothing to condition on: c stands
    fixed = BdsgdCutoff(FixedPredictor(np.ones((4, 4))), num_samples=4, stopping="fixed")
    assert not fixed.online and fixed.name == "bdsgd:fixed"
    with pytest.raises(ConfigError, match="stopping must be one of .*got 'sometimes'"):
        BdsgdCutoff(FixedPredictor(np.ones((4, 4))), stopping="sometimes")


def test_ewma_online_draws_the_waiting_workers_above_the_present():
    policy = EwmaCutoff(4, num_samples=64, stopping="online")
    assert policy.online and policy.name == "ewma:online"
    for _ in range(10):
        policy.observe(np.array([1.0, 1.0, 1.0, 2.0]), np.zeros(4, dtype=bool))
    policy.choose(ALL)
    now, runtimes, arrived = arrivals(2, (1.0, 1.0, 1.5, 2.0))
    draws = policy.conditional(now, runtimes, arrived, ~arrived)
    assert draws.shape == (64, 2) and np.all(draws > now)


def test_an_online_policy_with_nothing_to_go_on_waits_for_everyone():
    policy = EwmaCutoff(4, stopping="online")
    assert policy.choose(ALL) == 4  # no history: every worker
    assert policy.revise(*arrivals(1)) == 4  # and the first arrival does not end it


def test_describe_predicts_the_time_of_the_c_the_iteration_ended_with():
    policy, _ = online_bdsgd(extra=0.01)  # chose 3, then waits for the 4th
    assert policy.revise(*arrivals(3)) == 4
    policy.observe(np.array([1.0, 1.1, 1.2, 1.21]), np.zeros(4, dtype=bool))
    assert policy.describe()["pred_q50"] == pytest.approx(10.0)  # the samples' x_(4), not x_(3)


def test_ewma_online_draws_stay_above_the_present_far_in_its_tail():
    policy = EwmaCutoff(4, num_samples=64, stopping="online")
    for _ in range(30):  # a tight history around 1 s
        policy.observe(np.array([1.0, 1.01, 0.99, 1.0]), np.zeros(4, dtype=bool))
    policy.choose(ALL)
    _, runtimes, arrived = arrivals(1, (1.0, 1e4, 1e4, 1e4))
    # 1e4 s is about 90 spreads out: P(x > now) underflows to 0 in plain arithmetic
    draws = policy.conditional(1e4, runtimes, arrived, ~arrived)
    assert np.isfinite(draws).all() and np.all(draws >= 1e4)
