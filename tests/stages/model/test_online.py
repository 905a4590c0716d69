"""The online factor on x_(c)'s spread: adaptive conformal inference on the order statistic."""

from __future__ import annotations

import dataclasses

import numpy as np
from bdsgd.stages.model.checkpoint import load_checkpoint
from bdsgd.stages.model.online import (
    LEVEL_BOOST,
    LEVEL_DECAY,
    LEVEL_STEP,
    STEP,
    TAIL,
    OnlineSpread,
    order_statistic_at_cut,
)

from tests.stages.model.test_recalibrate import fit_small, order_stat_coverage, shared_cluster


def normal_draws(rng, spread: float, samples: int = 256, workers: int = 8) -> np.ndarray:
    """(S, N) draws whose every worker moves with a shared N(0, spread^2) level."""
    level = rng.normal(0.0, spread, (samples, 1))
    return np.exp(level + 0.1 * rng.standard_normal((samples, workers)))


def shown(rng, spread: float, workers: int = 8) -> np.ndarray:
    return np.exp(rng.normal(0.0, spread) + 0.1 * rng.standard_normal(workers))


def test_a_predictive_too_sure_widens_and_one_too_vague_narrows():
    rng = np.random.default_rng(0)
    sure, vague = OnlineSpread(), OnlineSpread()
    for _ in range(50):
        for online, spread in ((sure, 0.01), (vague, 2.0)):
            online.drawn(normal_draws(rng, spread))
            online.update(shown(rng, 0.3), np.zeros(8, bool))
    assert sure.factor > 1.5 and vague.factor < 0.7


def test_a_miss_moves_up_by_nine_times_what_a_hit_moves_down():
    rng = np.random.default_rng(1)
    online, draws = OnlineSpread(), normal_draws(rng, 0.3)
    online.drawn(draws)
    assert online.update(np.full(8, 50.0), np.zeros(8, bool)) is True  # far above every draw
    assert np.isclose(online.log_factor, STEP * (1 - 2 * TAIL))
    online.drawn(draws)
    c, predicted, _ = order_statistic_at_cut(draws, draws[0], np.zeros(8, bool), np.ones(8, bool))
    x = np.full(8, 50.0)
    x[:c] = np.median(predicted)  # x_(c) at the draws' median
    assert online.update(x, np.zeros(8, bool)) is False
    assert np.isclose(online.log_factor, STEP * (1 - 4 * TAIL))


def pits_of_a_slow_cluster(online: OnlineSpread, seed: int = 3) -> list[float]:
    """x_(c)'s PITs over 120 iterations of a cluster 20% slower than the draws say (spread
    0.05), the draws moved by ``online``'s shift."""
    rng, pits = np.random.default_rng(seed), []
    for _ in range(120):
        online.drawn(normal_draws(rng, 0.05) * np.exp(online.log_shift))
        x = shown(rng, 0.05) * 1.2
        c, predicted, seen = order_statistic_at_cut(online.draws, x, np.zeros(8, bool),
                                                    np.ones(8, bool))  # fmt: skip
        pits.append(float((predicted < seen).mean()))
        online.update(x, np.zeros(8, bool))
    return pits


def test_x_c_that_keeps_falling_above_the_draws_moves_them_up_until_it_sits_among_them():
    online = OnlineSpread()
    pits = pits_of_a_slow_cluster(online)
    assert 0.12 < online.log_shift < 0.25  # log 1.2 = 0.18
    assert np.mean(pits[:3]) > 0.9 and 0.3 < np.mean(pits[-40:]) < 0.7


def test_the_shift_moves_faster_at_a_runs_start_than_the_constant_step_alone():
    """The decaying boost takes a run's offset out in fewer iterations, then the step is the
    constant one again."""
    boosted, constant = OnlineSpread(), OnlineSpread(level_boost=0.0)
    fast, slow = pits_of_a_slow_cluster(boosted), pits_of_a_slow_cluster(constant)
    assert np.mean(fast[:20]) < np.mean(slow[:20]) - 0.1  # 0.69 against 0.87
    assert abs(np.mean(fast[-40:]) - np.mean(slow[-40:])) < 0.1
    assert boosted.moves == constant.moves == 120
    assert np.isclose(boosted.shift_step, LEVEL_STEP, atol=1e-5)
    assert constant.shift_step == LEVEL_STEP


def test_the_shift_moves_by_its_step_times_the_spread_times_2u_minus_1():
    rng = np.random.default_rng(4)
    online, draws = OnlineSpread(), normal_draws(rng, 0.3)
    online.drawn(draws)
    online.update(np.full(8, 50.0), np.zeros(8, bool))  # above every draw: u = 1
    c, predicted, _ = order_statistic_at_cut(draws, draws[0], np.zeros(8, bool), np.ones(8, bool))
    assert np.isclose(online.log_shift, (LEVEL_STEP + LEVEL_BOOST) * np.log(predicted).std())
    assert np.isclose(online.shift_step, LEVEL_STEP + LEVEL_BOOST * LEVEL_DECAY)


def test_x_c_drawn_from_the_predictive_leaves_the_shift_near_zero():
    rng = np.random.default_rng(5)
    online, shifts = OnlineSpread(), []
    for _ in range(400):
        online.drawn(normal_draws(rng, 0.3) * np.exp(online.log_shift))
        online.update(shown(rng, 0.3), np.zeros(8, bool))
        shifts.append(online.log_shift)
    # it wanders (sd 0.14-0.19 of the spread over seeds 0-4), about zero
    assert np.std(shifts) < 0.3 * 0.25 and abs(np.mean(shifts)) < 0.3 * 0.1


def test_nothing_moves_without_draws_or_where_x_c_is_not_shown():
    online = OnlineSpread()
    assert online.update(np.ones(8), np.zeros(8, bool)) is None  # nothing drawn
    online.drawn(normal_draws(np.random.default_rng(2), 0.3))
    censored = np.ones(8, bool)  # every worker cut off: x_(c) unseen
    assert online.update(np.full(8, 0.01), censored) is None and online.log_factor == 0.0
    assert online.log_shift == 0.0


def test_the_online_factor_covers_x_c_where_the_cluster_changed_after_the_fit(tmp_path):
    # fitted where workers share no slowdown, replayed where they share one (sd 0.4): the model's
    # x_(c) is far too sure (about half covered); adjusted online, most of it is covered again
    calm = shared_cluster(300, 12, shared_sd=0.0, seed=1)
    fit_small(tmp_path, calm, 20, 16, 4, holdout=0.0)
    ckpt = dataclasses.replace(load_checkpoint(tmp_path / "m.pt"), common=(0.0, 0.0, 1.0, 1.0))
    wild = shared_cluster(400, 12, shared_sd=0.4, seed=5)
    fixed = order_stat_coverage(ckpt, wild, 100, online=False)
    adjusted = order_stat_coverage(ckpt, wild, 100, online=True)
    assert fixed < 0.6 and 0.75 < adjusted <= 0.97
