"""The user's job (``job:slow_rank`` and its siblings) replayed through the policies in
simulation: bdsgd with a model whose per-rank body is too wide (as a fit on a short profile of
this job reads a tight run-time with rare 0.6 s spells) must not admit fewer gradients than pay
for themselves, and its self-check must leave a model that loses and come back to one that
wins."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bdsgd.stages.policies.cutoff import BdsgdCutoff, EcdfCutoff, EwmaCutoff
from bdsgd.stages.policies.registry import with_self_check
from bdsgd.stages.policies.selfcheck import self_check_report
from bdsgd.stages.simulate import replay
from bdsgd.stages.store import RunMatrix
from bdsgd.stages.stragglers import parse_stragglers
from scipy.special import log_ndtr, ndtri_exp

RANKS, ITERATIONS = 4, 400
HEALTHY, SLOW = np.log(0.16), np.log(0.4)


def job_run(spec: str = "job:slow_rank", seed: int = 1, iterations: int = ITERATIONS):
    model = parse_stragglers(spec, seed=seed)
    x = model.delays(iterations, RANKS)
    full = np.ones(x.shape, dtype=bool)
    return RunMatrix(spec, x, ~full, full, tuple(model.host_of(RANKS)))


class WideBody:
    """Each rank's log-normal at its own level, independent, with a body ``sigma`` wide: the
    job's ranks are tight (sd 0.05 in log) with a 0.6 s spell 8% of the time, which a
    log-normal body reads as a broad spread. Conditions on arrivals (truncated at the
    present), as the fitted model does. ``wrong_until``: before that iteration it believes
    every rank is healthy and tight (so it waits for the slow rank every iteration)."""

    def __init__(self, sigma: float = 0.6, wrong_until: int = 0, seed: int = 0) -> None:
        self.sigma, self.wrong_until, self.t = sigma, wrong_until, 0
        self.rng = np.random.default_rng(seed)
        self.drawn = 0

    def params(self) -> tuple[np.ndarray, float]:
        if self.t < self.wrong_until:
            return np.full(RANKS, HEALTHY - 0.7), 0.02
        return np.array([SLOW] + [HEALTHY] * (RANKS - 1)), self.sigma

    def observe(self, runtimes, censored) -> None:
        self.t += 1

    def sample(self, num_samples: int) -> torch.Tensor:
        mu, sigma = self.params()
        self.drawn = num_samples
        z = self.rng.standard_normal((num_samples, RANKS))
        return torch.from_numpy(np.exp(mu + sigma * z))

    def remaining(self, now_s, runtimes, arrived, waiting) -> np.ndarray:
        mu, sigma = self.params()
        mu = mu[waiting]
        log_above = log_ndtr((mu - np.log(now_s)) / sigma)
        u = np.log(self.rng.random((self.drawn, mu.size))) + log_above
        return np.exp(mu - sigma * ndtri_exp(u))


def _run(policy, run: RunMatrix):
    result = replay(policy, run, start=0, overhead_s=0.0)
    c, seconds = np.array(result.columns["c"]), np.array(result.columns["iteration_s"])
    return c.mean(), c.sum() / seconds.sum(), result


@pytest.mark.parametrize("spec", ["job:slow_rank", "job:two_slow", "job:host_spells"])
def test_bdsgd_admits_what_pays_on_the_job_and_is_not_slower_than_ecdf(spec):
    run = job_run(spec)
    ecdf_c, ecdf_rate, _ = _run(EcdfCutoff(seed=0), run)
    own_c, own_rate, _ = _run(BdsgdCutoff(WideBody()), run)
    # the wide body alone would stop at the second arrival where the third comes 10 ms later
    # (mean c about 0.7 below ecdf's); the arrival record's floor waits for it
    assert own_c > ecdf_c - 0.35
    # (within 3%: the standing c's arrival ends an iteration unasked, as in training, so a
    # revision cannot raise c there; on two_slow bdsgd then trails ecdf by about 2%)
    assert own_rate >= 0.97 * ecdf_rate


def test_without_the_floor_the_wide_body_gives_gradients_away():
    """The failure the floor removes, shown with the record turned off."""
    run = job_run()
    ecdf_c, _, _ = _run(EcdfCutoff(seed=0), run)
    bare = BdsgdCutoff(WideBody())
    bare.record.pays = lambda k, rate: False  # no floor
    bare_c, _, _ = _run(bare, run)
    floored_c, _, _ = _run(BdsgdCutoff(WideBody()), run)
    assert bare_c < ecdf_c - 0.4
    assert floored_c > bare_c + 0.3


def _checked(predictor) -> object:
    own = BdsgdCutoff(predictor, num_samples=256)
    return with_self_check(own, RANKS, seed=0, num_samples=256, mc={"objective": "long-run"})


def test_self_check_leaves_a_losing_model_within_a_few_iterations_and_comes_back():
    """Wrong for the first 150 iterations (it waits for the slow rank every time), then right:
    the check plays a peer's c from within the first ten decisions, and the model's c again,
    most of the time, once it is ahead."""
    run = job_run(iterations=600)
    policy = _checked(WideBody(wrong_until=150))
    _, _, result = _run(policy, run)
    report = self_check_report(policy)
    peers = result.columns["peer"]
    assert report["first_leaned"] is not None and report["first_leaned"] <= 10
    assert sum(p is not None for p in peers[10:150]) > 0.9 * 140
    assert sum(p is None for p in peers[-200:]) > 0.75 * 200


def test_self_check_keeps_a_model_that_is_ahead_on_the_job():
    run = job_run()
    policy = _checked(WideBody())
    _, rate, result = _run(policy, run)
    report = self_check_report(policy)
    assert report["leaned_share"] < 0.1
    _, ewma_rate, _ = _run(EwmaCutoff(RANKS, seed=0), run)
    assert rate >= ewma_rate
