"""``:goodput``: the cutoff policies value c gradients at gain(c) from the pushed noise scale."""

from __future__ import annotations

import numpy as np
import pytest
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.goodput import gain
from bdsgd.stages.policies.cutoff import BdsgdCutoff, ElfvingCutoff, best_cutoff, goodput_worth
from bdsgd.stages.policies.registry import make_policy

from tests.stages.policies.test_cutoff import ArrivalPredictor, FixedPredictor, arrivals

N = 8
LIVE = np.ones(N, dtype=bool)
# order statistics growing a little slower than c: throughput c / x_(c) rises up to c = N
SUBLINEAR = np.arange(1, N + 1) ** 0.9
HIGH_NOISE = 1e9  # samples: every gradient counts (gain(c) ~ c)
LOW_NOISE = 8.0  # samples, with batch 8: phi = 1, gain(8) = 16/9 < 2


def policy_on(samples: np.ndarray, goodput: bool, noise: float | None, **kw) -> BdsgdCutoff:
    policy = BdsgdCutoff(
        FixedPredictor(np.tile(samples, (4, 1))), num_samples=4, goodput=goodput, **kw
    )
    policy.set_noise_scale(noise, 8)
    return policy


def test_high_noise_chooses_as_throughput_does_low_noise_fewer_workers():
    throughput = policy_on(SUBLINEAR, goodput=False, noise=LOW_NOISE).choose(LIVE)
    high = policy_on(SUBLINEAR, goodput=True, noise=HIGH_NOISE).choose(LIVE)
    low = policy_on(SUBLINEAR, goodput=True, noise=LOW_NOISE).choose(LIVE)
    assert throughput == high == N  # the throughput policy ignores the noise scale
    assert low == 2  # gain(c) / x_(c) falls with c: the fewest that still measure the noise


def test_goodput_never_waits_for_a_single_gradient_while_two_live():
    # no noise: gain(c) = 1 for every c, so the fastest worker alone would win; c = 1 would
    # leave the noise scale unmeasured for ever
    policy = policy_on(SUBLINEAR, goodput=True, noise=0.0)
    assert policy.choose(LIVE) == 2
    one = np.zeros(N, dtype=bool)
    one[3] = True
    assert policy.choose(one) == 1  # one worker left: one gradient is all there is
    assert goodput_worth(policy, 1).tolist() == [1.0]


def test_unknown_noise_scale_counts_every_gradient():
    policy = policy_on(SUBLINEAR, goodput=True, noise=None)
    assert policy.choose(LIVE) == N
    worth = goodput_worth(policy, 4)
    assert worth[0] == -np.inf and worth[1:].tolist() == [2.0, 3.0, 4.0]


def test_best_cutoff_with_worth_in_place_of_c():
    expected = np.array([1.0, 2.0, 3.0])
    assert best_cutoff(expected, 0.0) == 3  # a tie in c / x_(c): the larger c
    assert best_cutoff(expected, 0.0, worth=np.array([1.0, 1.5, 1.8])) == 1
    assert best_cutoff(expected, 0.0, rate=0.5, worth=np.array([1.0, 2.0, 2.2])) == 2


def test_long_run_goodput_tracks_the_gain_achieved():
    # lambda is goodput: sum gain(c) / sum seconds of the iterations the policy chose
    policy = policy_on(SUBLINEAR, goodput=True, noise=LOW_NOISE)
    for _ in range(30):
        c = policy.choose(LIVE)
        policy.observe(np.minimum(SUBLINEAR, SUBLINEAR[c - 1]), np.arange(N) >= c)
    assert c == 2
    assert policy.tracker.rate() == pytest.approx(gain(2, LOW_NOISE, 8) / SUBLINEAR[1])
    plain = policy_on(SUBLINEAR, goodput=False, noise=LOW_NOISE)
    for _ in range(30):
        c = plain.choose(LIVE)
        plain.observe(np.minimum(SUBLINEAR, SUBLINEAR[c - 1]), np.arange(N) >= c)
    assert c == N and plain.tracker.rate() == pytest.approx(N / SUBLINEAR[-1])


def online(noise: float, extra: float) -> BdsgdCutoff:
    predictor = ArrivalPredictor(np.tile([1.0, 1.1, 1.2, 10.0], (4, 1)), extra)
    policy = BdsgdCutoff(predictor, num_samples=4, objective="iteration", goodput=True)
    policy.set_noise_scale(noise, 8)
    policy.choose(np.ones(4, dtype=bool))
    return policy


def test_online_revision_values_arrivals_at_their_gain():
    # the last worker is 0.01 s away at the 3rd arrival: 4 / 1.21 beats 3 / 1.2, but with no
    # noise one more gradient is worth nothing, and waiting costs time
    assert online(HIGH_NOISE, extra=0.01).revise(*arrivals(3)) == 4
    assert online(0.0, extra=0.01).revise(*arrivals(3)) == 3
    # the others are 10 s away: throughput stops at the first arrival, goodput takes two
    assert online(0.0, extra=10.0).revise(*arrivals(1)) == 2


def test_elfving_goodput_drops_more_when_the_gradients_agree():
    values = np.concatenate([np.full(40, 1.0), np.full(10, 1.5)])
    plain, good = ElfvingCutoff(), ElfvingCutoff(goodput=True)
    for p in (plain, good):
        for chunk in values.reshape(5, 10):
            p.observe(chunk, np.zeros(10, dtype=bool))
    good.set_noise_scale(LOW_NOISE, 8)
    live = np.ones(10, dtype=bool)
    assert good.name == "elfving:goodput"
    assert good.choose(live) < plain.choose(live)
    good.set_noise_scale(HIGH_NOISE, 8)
    assert good.choose(live) == plain.choose(live)


def test_registry_names_and_errors():
    with pytest.raises(ConfigError, match="needs a fitted model"):  # the spec itself is fine
        make_policy("bdsgd:goodput", 4)
    assert make_policy("ewma:online:goodput", 4).name == "ewma:goodput:online"
    assert make_policy("ecdf:goodput:iteration", 4).name == "ecdf:goodput:iteration"
    assert make_policy("elfving:goodput", 4).goodput
    assert not make_policy("ewma", 4).goodput
    for spec in ("static:3:goodput", "full:goodput", "k-async:2:goodput", "oracle:goodput"):
        with pytest.raises(ConfigError, match="goodput applies to the dynamic cutoff policies"):
            make_policy(spec, 4)
    with pytest.raises(ConfigError, match="at most one of each"):
        make_policy("ewma:goodput:goodput", 4)
    with pytest.raises(ConfigError, match="unknown policy"):
        make_policy("elfving:goodput:iteration", 4)


def test_exploring_passes_the_noise_scale_on():
    policy = make_policy("ewma:goodput", 4, explore=0.5)
    policy.set_noise_scale(123.0, 16)
    assert (policy.inner.noise_scale, policy.inner.batch_size) == (123.0, 16)
