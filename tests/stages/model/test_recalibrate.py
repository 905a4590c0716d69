"""The shared log-slowdown fit adds after training, so that x_(c) is calibrated."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from bdsgd.stages.fit import FitConfig, run_fit
from bdsgd.stages.model.checkpoint import NO_RECALIBRATION, load_checkpoint
from bdsgd.stages.model.evaluate import Filtered, PitCollector, _observed, evaluate
from bdsgd.stages.model.predictor import predictor_from
from bdsgd.stages.model.recalibrate import (
    WIDENINGS,
    common_slowdown,
    recalibration_spans,
    widening,
)
from bdsgd.stages.store import RunMatrix, TraceStore, matrix_rows


def shared_cluster(iterations: int, workers: int, shared_sd: float, seed: int = 0) -> RunMatrix:
    """One worker per host; each iteration every worker is slowed by the same log-normal factor
    (sd ``shared_sd``), on top of its own noise (sd 0.3)."""
    rng = np.random.default_rng(seed)
    common = rng.normal(0.0, shared_sd, (iterations, 1))
    x = np.exp(np.log(0.05) + common + 0.3 * rng.standard_normal((iterations, workers)))
    full = np.ones(x.shape, dtype=bool)
    return RunMatrix("shared", x, ~full, full, tuple(f"fn{w}" for w in range(workers)))


def fit_small(tmp_path, run: RunMatrix, steps: int, window: int, batch: int, **overrides):
    """``run`` written to a fresh store under ``tmp_path`` and fitted briefly (no progress bar);
    the fit's result (the checkpoint is ``tmp_path / "m.pt"``)."""
    TraceStore(tmp_path / "t").append(matrix_rows(run))
    config = FitConfig(
        traces=tmp_path / "t", checkpoint=tmp_path / "m.pt", steps=steps, window=window,
        batch=batch, progress=False, **overrides,
    )  # fmt: skip
    return run_fit(config)


def order_stat_coverage(ckpt, run: RunMatrix, start: int, online: bool = False) -> float:
    """x_(c) coverage from ``start`` on; the checkpoint's recalibration alone unless ``online``."""
    predictor = predictor_from(ckpt, list(range(run.shape[1])), list(run.hosts), seed=1)
    if not online:
        predictor.online = None
    pits = PitCollector()
    for t in range(run.shape[0]):
        x, cens, present = _observed(run, t)
        if t >= start:
            pits.add(predictor.sample(256).numpy(), x, cens, present)
        predictor.observe(x, cens)
    return pits.summary()["order_stat"]["coverage"]


def test_a_shared_slowdown_the_model_missed_is_added_and_covers_x_c(tmp_path):
    # a short fit barely learns the shared factor: x_(c) is under-covered until recalibrated
    run = shared_cluster(500, 12, shared_sd=0.4)
    result = fit_small(tmp_path, run, 20, 16, 4, holdout=0.2, eval_samples=64)
    ckpt = load_checkpoint(tmp_path / "m.pt")
    shift, sd, widen, tighten = ckpt.common
    assert sd > 0.1 and ckpt.summary["common_slowdown"] == [shift, sd, widen, tighten]
    assert result.calibration["order_stat"]["coverage"] >= 0.8
    unshared = dataclasses.replace(ckpt, common=(0.0, 0.0, widen, tighten))
    assert order_stat_coverage(unshared, run, 400) < order_stat_coverage(ckpt, run, 400)


def test_too_few_iterations_leave_the_model_as_it_is(tmp_path):
    run = shared_cluster(60, 6, shared_sd=0.4)
    fit_small(tmp_path, run, 3, 8, 2, holdout=0.2, eval_samples=16)
    ckpt = load_checkpoint(tmp_path / "m.pt")
    assert ckpt.common[:2] == (0.0, 0.0)  # 6 iterations in the first half of the held-out 12
    assert common_slowdown(ckpt, [run], recalibration_spans([run], 0.2))[:2] == (0.0, 0.0)
    assert recalibration_spans([run], 0.2) == [(48, 54)] and recalibration_spans([run], 0) == [
        (45, 60)
    ]


def test_the_shared_slowdown_moves_every_worker_of_a_draw_together(tmp_path):
    run = shared_cluster(300, 8, shared_sd=0.0)
    fit_small(tmp_path, run, 3, 8, 2, holdout=0.0)
    ckpt = load_checkpoint(tmp_path / "m.pt")
    plain = predictor_from(dataclasses.replace(ckpt, common=(0.0, 0.0, 1.0)), seed=3)
    shared = predictor_from(dataclasses.replace(ckpt, common=(0.0, 1.0, 1.0)), seed=3)
    a, b = (torch.log(p.sample(4096)).numpy() for p in (plain, shared))
    # a shared N(0, s^2) term in y adds (s * norm.scale)^2 to the variance of a draw's mean
    extra = np.var(b.mean(axis=1)) - np.var(a.mean(axis=1))
    assert abs(extra - ckpt.norm.scale**2) < 0.25 * ckpt.norm.scale**2


def test_a_spread_the_model_missed_widens_every_worker(tmp_path):
    # the held-out part is twice as spread out as the training part: the recalibration, measured
    # on its first half, widens each worker's spread, and the second half is covered again
    calm = shared_cluster(400, 8, shared_sd=0.0, seed=1)
    wild = shared_cluster(100, 8, shared_sd=0.0, seed=2)
    mean = np.log(0.05)
    wide = np.exp(mean + 2.0 * (np.log(wild.runtimes) - mean))
    x = np.concatenate([calm.runtimes, wide])
    run = RunMatrix("wild", x, np.zeros(x.shape, bool), np.ones(x.shape, bool), calm.hosts)
    result = fit_small(tmp_path, run, 30, 16, 4, holdout=0.2, eval_samples=64)
    assert load_checkpoint(tmp_path / "m.pt").common[2] >= 1.2
    assert result.calibration["runtime"]["coverage"] >= 0.85


def test_an_x_c_the_model_predicts_too_spread_is_narrowed(tmp_path):
    # fitted where every iteration's workers are slowed together (sd 0.4), the model spreads
    # x_(c) widely; on a run without that shared slowdown the span covers nearly every x_(c),
    # and the recalibration narrows the spread of the draws' levels (a shared sd cannot); 60
    # steps: at 30 the spread learnt sat at the edge of the narrowing's threshold
    wild = shared_cluster(400, 12, shared_sd=0.4)
    fit_small(tmp_path, wild, 60, 16, 4, holdout=0.0)
    ckpt = dataclasses.replace(load_checkpoint(tmp_path / "m.pt"), common=NO_RECALIBRATION)
    calm = shared_cluster(400, 12, shared_sd=0.0, seed=4)
    before = order_stat_coverage(ckpt, calm, 300)
    shift, sd, widen, tighten = common_slowdown(ckpt, [calm], [(200, 300)])
    narrowed = dataclasses.replace(ckpt, common=(shift, sd, widen, tighten))
    after = order_stat_coverage(narrowed, calm, 300)
    assert before > 0.95 and sd == 0.0 and tighten < 1.0 and 0.75 < after < before


def test_narrowing_moves_a_draws_workers_together(tmp_path):
    run = shared_cluster(300, 8, shared_sd=0.4)
    fit_small(tmp_path, run, 3, 8, 2, holdout=0.0)
    ckpt = load_checkpoint(tmp_path / "m.pt")
    plain = predictor_from(dataclasses.replace(ckpt, common=NO_RECALIBRATION), seed=3)
    narrow = predictor_from(dataclasses.replace(ckpt, common=(0.0, 0.0, 1.0, 0.0)), seed=3)
    a, b = (torch.log(p.sample(4096)).numpy() for p in (plain, narrow))
    # a factor of 0 gives every draw the same mean level; each worker keeps its own noise
    assert np.ptp(b.mean(axis=1)) < 1e-4 < 0.05 < np.ptp(a.mean(axis=1))
    assert np.var(b, axis=0).mean() > 0.5 * np.var(a, axis=0).mean()


def test_filtering_each_run_once_changes_nothing(tmp_path):
    # fit's recalibration and evaluation share each run's filter up to the held-out start
    # (evaluate.Filtered); every figure must be what filtering from the start gives
    run = shared_cluster(160, 6, shared_sd=0.3)
    fit_small(tmp_path, run, steps=20, window=16, batch=4)
    ckpt = dataclasses.replace(load_checkpoint(tmp_path / "m.pt"), common=NO_RECALIBRATION)
    spans = recalibration_spans([run], 0.2)
    filtered = Filtered()
    once = common_slowdown(ckpt, [run], spans, seed=3, filtered=filtered)
    assert once == common_slowdown(ckpt, [run], spans, seed=3)
    recalibrated = dataclasses.replace(ckpt, common=once)
    shared = evaluate(recalibrated, [run], 0.2, 64, 3, calibration_skip=0.5, filtered=filtered)
    assert shared == evaluate(recalibrated, [run], 0.2, 64, 3, calibration_skip=0.5)
    assert len(filtered._kept) == 1  # one run, one start: filtered once


def _span(values: np.ndarray, tail: float = 0.0) -> tuple[float, np.ndarray]:
    """The unwidened coverage of ``values`` under a unit normal bulk with a share ``tail`` of a
    wide component 12 units up (a host's jump), and their log-likelihood under the bulk widened
    by each of :data:`WIDENINGS`."""
    from scipy.stats import norm

    bulk, jump = norm(0.0, 1.0), norm(12.0, 1.0)
    pit = (1 - tail) * bulk.cdf(values) + tail * jump.cdf(values)
    coverage = float(np.mean((pit >= 0.05) & (pit <= 0.95)))
    scores = [np.log((1 - tail) * norm(0.0, f).pdf(values) + tail * jump.pdf(values)).sum()
              for f in WIDENINGS]  # fmt: skip
    return coverage, np.array(scores)


def _widening(coverage: float, scores: np.ndarray) -> tuple[int, int]:
    """:func:`widening`'s choice, and how many times it asked for the scores."""
    asked = []
    k = widening(coverage, lambda: asked.append(1) or scores)
    return k, len(asked)


def test_an_under_spread_bulk_is_widened_to_its_spread():
    values = np.random.default_rng(0).normal(0.0, 1.35, 4000)
    k, asked = _widening(*_span(values))
    assert WIDENINGS[k] == 1.35 and asked == 1


def test_a_calibrated_bulk_is_not_widened_nor_scored():
    values = np.random.default_rng(0).normal(0.0, 1.0, 4000)
    assert _widening(*_span(values)) == (0, 0)  # covered: the scores' pass is not taken


def test_values_only_a_tail_covers_do_not_widen_the_bulk():
    # a calibrated bulk and 12% host spells the model gives a 1% chance: their PITs sit near 1,
    # under-covered, and no widening of the bulk covers 90% of the values; widening for them
    # (the widest factor, before) made the bulk twice as wide as it is
    rng = np.random.default_rng(1)
    values = np.where(rng.random(4000) < 0.12, rng.normal(12.0, 1.0, 4000), rng.normal(0, 1, 4000))
    coverage, scores = _span(values, tail=0.01)
    assert coverage < 0.85  # the gate opens
    assert _widening(coverage, scores) == (0, 1)
