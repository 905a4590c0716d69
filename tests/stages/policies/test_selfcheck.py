"""The self-checking bdsgd: it leans on a simple peer when its predictive loses, and only then."""

from __future__ import annotations

import numpy as np
import torch
from bdsgd.stages.policies.cutoff import BdsgdCutoff, EcdfCutoff, EwmaCutoff
from bdsgd.stages.policies.registry import with_self_check
from bdsgd.stages.policies.selfcheck import (
    SURPRISE_Z,
    SelfChecking,
    far_outside,
    lean_message,
    record_needed,
    self_check_report,
    shadow_outcome,
)
from bdsgd.stages.simulate import replay
from bdsgd.stages.store import RunMatrix
from scipy.special import log_ndtr, ndtri_exp

WORKERS, ITERATIONS = 16, 500
MU = np.log(0.05) + np.linspace(-0.3, 0.3, WORKERS)  # worker w's log-mean
SIGMA = 0.8  # heavy, independent log-normal tails


def independent_tails(seed: int = 0, load: float = 0.0) -> RunMatrix:
    """One worker per host, independent log-normal run-times: a cluster unlike ours; ``load`` > 0
    adds that much to every log run-time of the odd iterations (a load the peers cannot
    foresee, the model can)."""
    rng = np.random.default_rng(seed)
    odd = (np.arange(ITERATIONS) % 2)[:, None]
    x = np.exp(MU + load * odd + SIGMA * rng.standard_normal((ITERATIONS, WORKERS)))
    full = np.ones(x.shape, dtype=bool)
    return RunMatrix("tails", x, ~full, full, tuple(f"fn{w}" for w in range(WORKERS)))


class LogNormalPredictor:
    """A Predictor test double drawing independent log-normals N(mu, sigma) per worker: the true
    predictive of :func:`independent_tails` when given its MU and SIGMA."""

    def __init__(self, mu: np.ndarray, sigma: float, load: float = 0.0, seed: int = 1) -> None:
        self.mu, self.sigma, self.load = mu, sigma, load
        self.rng = np.random.default_rng(seed)
        self.observed = 0

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.observed += 1

    def next_mu(self) -> np.ndarray:
        return self.mu + self.load * (self.observed % 2)

    def sample(self, num_samples: int) -> torch.Tensor:
        self.drawn = num_samples
        z = self.rng.standard_normal((num_samples, self.mu.size))
        return torch.from_numpy(np.exp(self.next_mu() + self.sigma * z))

    def remaining(self, now_s, runtimes, arrived, waiting) -> np.ndarray:
        """The waiting workers' own log-normals above the present (independent workers)."""
        mu = self.next_mu()[waiting]
        log_above = log_ndtr((mu - np.log(now_s)) / self.sigma)
        u = np.log(self.rng.random((self.drawn, mu.size))) + log_above
        return np.exp(mu - self.sigma * ndtri_exp(u))


def checked(predictor: LogNormalPredictor) -> SelfChecking:
    own = BdsgdCutoff(predictor, stopping="fixed")
    policy = with_self_check(own, WORKERS, seed=0, num_samples=256, mc={"objective": "long-run"})
    assert isinstance(policy, SelfChecking)
    return policy


def test_leans_on_the_peer_when_the_predictive_is_wrong_on_purpose():
    # the model believes every worker is tight around the fast ones: it waits for all 16, and the
    # heavy tail makes every iteration last as long as its slowest worker
    wrong = checked(LogNormalPredictor(MU - 0.5, 0.02))
    result = replay(wrong, independent_tails(), start=300, overhead_s=0.0)
    report = self_check_report(wrong)
    assert report["decided"] == ITERATIONS - 300
    assert report["leaned_share"] > 0.9 and report["first_leaned"] == 0  # known from the warm-up
    assert report["rates"]["ewma"] > 1.2 * report["rates"][wrong.name]
    peers = result.columns["peer"]
    assert sum(p is not None for p in peers) == report["leaned"]
    # what it played is the peers' c, not the wrong model's c = N
    assert np.mean(result.columns["c"]) < WORKERS - 2
    assert "leaned on a simple peer" in lean_message("bdsgd", report)

    unchecked = BdsgdCutoff(LogNormalPredictor(MU - 0.5, 0.02), stopping="fixed")
    alone = replay(unchecked, independent_tails(), start=300, overhead_s=0.0)
    assert _throughput(result) > 1.2 * _throughput(alone)


def test_does_not_lean_when_the_predictive_is_right():
    # every other iteration is three times slower: the model knows, the peers average it out
    load = np.log(3.0)
    right = checked(LogNormalPredictor(MU, SIGMA, load))
    result = replay(right, independent_tails(load=load), start=300, overhead_s=0.0)
    report = self_check_report(right)
    assert report["leaned"] == 0 and lean_message("bdsgd", report) is None
    assert all(p is None for p in result.columns["peer"])
    assert report["rates"][right.name] > 1.05 * max(
        report["rates"]["ewma"], report["rates"]["ecdf"]
    )


def test_a_right_predictive_on_a_tie_loses_next_to_nothing_to_the_check():
    # independent tails and the true predictive: the peers do about as well, so the check may
    # lean on them now and then; it must cost at most a point of throughput
    right = checked(LogNormalPredictor(MU, SIGMA))
    checked_run = replay(right, independent_tails(), start=300, overhead_s=0.0)
    alone = BdsgdCutoff(LogNormalPredictor(MU, SIGMA), stopping="fixed")
    unchecked_run = replay(alone, independent_tails(), start=300, overhead_s=0.0)
    assert _throughput(checked_run) > 0.99 * _throughput(unchecked_run)


def test_shadow_outcome_is_exact_where_the_arrivals_cover_the_peers_c():
    rng = np.random.default_rng(3)
    peer = EwmaCutoff(WORKERS, seed=0)
    for _ in range(50):
        peer.observe(np.exp(MU + SIGMA * rng.standard_normal(WORKERS)), np.zeros(WORKERS, bool))
    x = np.exp(MU + SIGMA * rng.standard_normal(WORKERS))
    live = np.ones(WORKERS, dtype=bool)
    everyone = np.ones(WORKERS, dtype=bool)
    c, seconds, exact = shadow_outcome(peer, live, x, everyone)
    assert exact and seconds == np.sort(x)[c - 1]
    # cut off after two arrivals: the peer's c is beyond them, so its time is imputed from its
    # own conditional, never below the cut
    first_two = np.zeros(WORKERS, dtype=bool)
    first_two[np.argsort(x)[:2]] = True
    cut = np.where(first_two, x, np.sort(x)[1])
    c_cut, beyond, exact = shadow_outcome(peer, live, cut, first_two)
    assert c_cut > 2 and not exact and beyond >= np.sort(x)[1]


def test_warm_up_history_scores_every_expert_and_teaches_each_its_own_rate():
    policy = checked(LogNormalPredictor(MU, SIGMA))
    run = independent_tails()
    for t in range(60):
        policy.observe(run.runtimes[t], np.zeros(WORKERS, dtype=bool))
    assert [s.count for s in policy.scores] == [60, 60, 60]
    ecdf = policy.experts[2]
    assert isinstance(ecdf, EcdfCutoff) and ecdf.tracker.rate() is not None
    assert policy.own.predictor.observed == 60


def _throughput(result) -> float:
    return float(np.sum(result.columns["c"]) / np.sum(result.columns["iteration_s"]))


class FirstIterationOff(LogNormalPredictor):
    """The true predictive, but for the first iteration, which it places ``off`` in log away
    (a model fitted at other levels, before the run showed its own)."""

    def __init__(self, off: float) -> None:
        super().__init__(MU, SIGMA)
        self.off = off

    def next_mu(self) -> np.ndarray:
        return super().next_mu() + (self.off if self.observed == 0 else 0.0)


def test_a_record_needs_about_640_run_times():
    assert [record_needed(n) for n in (6, 16, 17, 32, 256, 1024)] == [8, 8, 38, 20, 3, 3]


def test_a_first_iteration_far_outside_the_predictive_leans_at_once_and_only_while_it_loses():
    # the model put the first iteration 2.5 (log) too slow: the check leans from the first
    # decision after it, before any record, and goes back once the model's fresh record is not
    # behind the peer's (here the model is right from the second iteration on)
    off = checked(FirstIterationOff(2.5))
    result = replay(off, independent_tails(), start=0, overhead_s=0.0)
    report = self_check_report(off)
    assert report["first_iteration_z"] < -SURPRISE_Z and report["first_leaned"] == 1
    assert result.columns["peer"][1] is not None
    assert report["leaned"] <= 20 and result.columns["peer"][-100:] == [None] * 100
    # a first iteration inside the predictive: no record yet, so no leaning in the first 40
    inside = checked(FirstIterationOff(0.0))
    early = replay(inside, independent_tails(), start=0, overhead_s=0.0)
    assert abs(self_check_report(inside)["first_iteration_z"]) < SURPRISE_Z
    assert early.columns["peer"][:40] == [None] * 40


def test_far_outside_measures_the_level_against_the_predicted_levels():
    rng = np.random.default_rng(0)
    draws = np.sort(np.exp(rng.normal(0.0, 0.3, (256, 64)) + rng.normal(0, 0.1, (256, 1))), 1)
    live = np.ones(64, dtype=bool)
    inside = np.exp(rng.normal(0.0, 0.3, 64))
    assert abs(far_outside(draws, inside, live)) < 3
    assert far_outside(draws, 0.5 * inside, live) < -SURPRISE_Z  # the whole run twice as fast
    assert far_outside(draws, 2.0 * inside, live) > SURPRISE_Z
    assert far_outside(None, inside, live) == 0.0


def test_on_a_30_iteration_run_of_256_workers_a_losing_model_is_left_within_four_decisions():
    workers, rng = 256, np.random.default_rng(5)
    mu = np.log(0.05) + rng.normal(0.0, 0.1, workers)
    x = np.exp(mu + SIGMA * rng.standard_normal((30, workers)))
    full = np.ones(x.shape, dtype=bool)
    run = RunMatrix("fresh", x, ~full, full, tuple(f"fn{w}" for w in range(workers)))
    # wrong on purpose: every worker tight around the fast ones, so it waits for nearly all
    own = BdsgdCutoff(LogNormalPredictor(mu - 0.5, 0.02), stopping="fixed")
    mc = {"objective": "long-run"}
    policy = with_self_check(own, workers, seed=0, num_samples=64, mc=mc)
    replay(policy, run, start=0, overhead_s=0.0)  # no warm-up: a new job
    report = self_check_report(policy)
    assert report["first_leaned"] is not None and report["first_leaned"] <= 4
    assert report["leaned"] >= 30 - 5


def test_the_drivers_settings_reach_every_expert():
    from bdsgd.stages.policies.cutoff import EcdfCutoff, EwmaCutoff
    from bdsgd.stages.policies.selfcheck import SelfChecking

    policy = SelfChecking(EcdfCutoff(seed=1), [EwmaCutoff(4), EcdfCutoff()])
    policy.overhead_s, policy.salvage_parts = 0.02, 4
    assert [(e.overhead_s, e.salvage_parts) for e in policy.experts] == [(0.02, 4)] * 3
    assert (policy.overhead_s, policy.salvage_parts) == (0.02, 4)


def on_probation(predictor: LogNormalPredictor) -> SelfChecking:
    own = BdsgdCutoff(predictor, stopping="fixed")
    return with_self_check(own, WORKERS, seed=0, num_samples=256, mc={"objective": "long-run"},
                           trusted=False, probation=True)  # fmt: skip


def test_a_model_on_probation_decides_once_its_record_leads_its_peers():
    # the right model of a load the peers cannot foresee, marked uncalibrated by fit: scored with
    # its peers on the recorded history (exact), its record leads theirs at the first decision
    load = np.log(3.0)
    policy = on_probation(LogNormalPredictor(MU, SIGMA, load))
    assert policy.leader != 0  # before any record: a peer
    result = replay(policy, independent_tails(load=load), start=300, overhead_s=0.0)
    report = self_check_report(policy)
    assert report["on_probation"] and not report["model_usable"]
    assert report["earned_at"] == 0 and policy.trusted and not policy.probation
    assert all(p is None for p in result.columns["peer"])
    assert report["rates"][policy.name] > 1.05 * max(
        report["rates"]["ewma"], report["rates"]["ecdf"]
    )


def test_a_wrong_model_on_probation_never_decides():
    wrong = on_probation(LogNormalPredictor(MU - 0.5, 0.02))
    result = replay(wrong, independent_tails(), start=100, overhead_s=0.0)
    report = self_check_report(wrong)
    assert report["earned_at"] is None and report["leaned_share"] == 1.0
    assert all(p is not None for p in result.columns["peer"])
    assert report["rates"][wrong.name] > 0  # scored in the shadow all along
    assert "marked uncalibrated" in lean_message("bdsgd", report)
    assert "never led them" in lean_message("bdsgd", report)
