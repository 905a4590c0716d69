"""Injected stragglers: spec parsing, determinism, host correlation, replay of a trace."""

from __future__ import annotations

import dataclasses
import math
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from bdsgd.stages.errors import ConfigError, TraceError
from bdsgd.stages.store import TraceStore
from bdsgd.stages.stragglers import (
    BLOCK,
    MATRIX_CELLS,
    NoStragglers,
    ReplayCluster,
    SyntheticCluster,
    parse_stragglers,
)


def test_none_spec_gives_zero_delays():
    model = parse_stragglers("none")
    assert isinstance(model.inner, NoStragglers)
    assert not model.delays(5, 3).any()
    assert model.host_of(3) is None


def test_synthetic_spec_parameters_are_parsed():
    model = parse_stragglers("synthetic:hosts=2,base_s=0.5,p_slow=0.1", seed=7, time_scale=0.5)
    cluster = model.inner
    assert isinstance(cluster, SyntheticCluster)
    assert (cluster.hosts, cluster.base_s, cluster.p_slow, cluster.seed) == (2, 0.5, 0.1, 7)
    assert isinstance(cluster.hosts, int)
    assert model.scale == 0.5
    assert model.host_of(4) == ["host0", "host1", "host0", "host1"]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("bogus", "unknown --stragglers spec 'bogus'"),
        ("none:extra", "unknown --stragglers spec 'none:extra'"),
        ("synthetic:nope=1", "bad synthetic straggler parameter 'nope=1'"),
        ("synthetic:hosts", "bad synthetic straggler parameter 'hosts'"),
        ("synthetic:hosts=two", "hosts needs a number, got 'two'"),
        ("synthetic:hosts=1.5", r"hosts needs a number, got '1\.5'"),
        ("synthetic:seed=3", "bad synthetic straggler parameter 'seed=3'"),
        ("synthetic:p_slow=2", r"p_slow must be in \[0, 1\]"),
        ("synthetic:base_s=0", "need base_s > 0"),
        ("synthetic:slow_factor=0.5", "slow_factor >= 1"),
        ("replay:", "replay:PATH needs a path"),
    ],
)
def test_bad_specs_are_config_errors(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_stragglers(spec)


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf])
def test_time_scale_must_be_finite_and_positive(scale):
    with pytest.raises(ConfigError, match="time-scale must be a finite number > 0"):
        parse_stragglers("none", time_scale=scale)


def test_same_seed_same_delays_other_seed_other_delays():
    a = parse_stragglers("synthetic", seed=3).delays(50, 6)
    b = parse_stragglers("synthetic", seed=3).delays(50, 6)
    c = parse_stragglers("synthetic", seed=4).delays(50, 6)
    assert a.shape == (50, 6) and (a > 0).all()
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_time_scale_multiplies_delays():
    full = parse_stragglers("synthetic", seed=1).delays(20, 4)
    scaled = parse_stragglers("synthetic", seed=1, time_scale=0.01).delays(20, 4)
    np.testing.assert_allclose(scaled, full * 0.01)


def two_slow_hosts() -> SyntheticCluster:
    """Two hosts whose slow spells (10x) come and go often; no other noise to speak of."""
    return SyntheticCluster(
        hosts=2,
        slow_factor=10.0,
        p_slow=0.2,
        p_recover=0.2,
        sigma=0.02,
        worker_spread=0.0,
        drift=0.0,
        spike_p=0.0,
        seed=5,
    )


def test_workers_of_a_slow_host_are_slow_together():
    cluster = two_slow_hosts()
    delays = cluster.delays(400, 4)  # workers 0, 2 on host0; 1, 3 on host1
    slow = delays > 3 * cluster.base_s
    assert slow.any() and not slow.all()
    np.testing.assert_array_equal(slow[:, 0], slow[:, 2])
    np.testing.assert_array_equal(slow[:, 1], slow[:, 3])
    assert (slow[:, 0] != slow[:, 1]).any()  # hosts are not slow in lockstep


def _replay_store(tmp_path, trace_rows) -> TraceStore:
    store = TraceStore(tmp_path / "traces")
    rows = trace_rows(iterations=3, workers=2)
    rows["runtime_s"] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # x[t, w] = 2t + w + 1
    store.append(rows)
    store.append(trace_rows(iterations=1, workers=5, run_id="run-z", runtime_s=9.0))
    return store


def test_replay_wraps_workers_and_iterations(tmp_path, trace_rows):
    store = _replay_store(tmp_path, trace_rows)
    model = parse_stragglers(f"replay:{store.path}", time_scale=2.0)
    assert isinstance(model.inner, ReplayCluster)
    delays = model.delays(5, 3)  # 3 workers over a 2-worker trace, 5 iterations over 3
    for t in range(5):
        for w in range(3):
            assert delays[t, w] == 2.0 * (2 * (t % 3) + (w % 2) + 1)
    assert model.host_of(3) == ["h0", "h1", "h0"]


def test_replay_of_a_single_file(tmp_path, trace_rows):
    store = _replay_store(tmp_path, trace_rows)
    model = parse_stragglers(f"replay:{store.files()[0]}")
    assert model.delays(3, 2).tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]


def test_replay_fills_a_missing_row_with_the_worker_median(tmp_path, trace_rows):
    rows = trace_rows(iterations=3, workers=2)
    rows["runtime_s"] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    store = TraceStore(tmp_path / "traces")
    store.append({k: v[:5] for k, v in rows.items()})  # iteration 2, worker 1 missing
    delays = parse_stragglers(f"replay:{store.path}").delays(3, 2)
    assert delays[2, 1] == 3.0  # median of 2.0 and 4.0


def test_replay_of_a_missing_path_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError):
        parse_stragglers(f"replay:{tmp_path / 'nothing'}")


def test_every_synthetic_parameter_is_documented_with_its_default():
    text = (Path(__file__).resolve().parents[2] / "docs" / "stragglers.md").read_text()
    for field in dataclasses.fields(SyntheticCluster):
        if field.name != "seed":
            assert f"| `{field.name}` | {field.default} |" in text, field.name


# -- one worker's column, computed as it is read --------------------------------------------
@pytest.mark.parametrize("spec", ["none", "synthetic", "synthetic:hosts=3,p_slow=0.2"])
def test_a_column_is_the_matrix_column(spec):
    model = parse_stragglers(spec, seed=2, time_scale=0.5)
    matrix = model.delays(30, 5)
    for w in range(5):
        column = model.column(30, 5, w)
        assert len(column) == 30
        assert [column[t] for t in range(30)] == matrix[:, w].tolist()


def test_a_replay_column_wraps_like_the_matrix(tmp_path, trace_rows):
    model = parse_stragglers(f"replay:{_replay_store(tmp_path, trace_rows).path}")
    matrix = model.delays(7, 3)
    for w in range(3):
        column = model.column(7, 3, w)
        assert len(column) == 7 and [column[t] for t in range(7)] == matrix[:, w].tolist()


def test_reading_past_the_end_of_a_column_is_an_index_error():
    column = parse_stragglers("synthetic").column(10, 2, 0)
    with pytest.raises(IndexError):
        column[10]


def test_a_column_of_a_huge_run_is_drawn_as_it_is_read():
    """--iterations 1e13: 5 x T x N floats up front would be 1.6 PB; a worker holds one block."""
    tracemalloc.start()
    try:
        column = parse_stragglers("synthetic", seed=1).column(10**13, 4, 1)
        values = [column[t] for t in (0, 1, BLOCK, 10**12 + 5, 10**13 - 1)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(column) == 10**13
    assert all(math.isfinite(v) and v > 0 for v in values)
    assert peak < 64 * BLOCK * 8  # a few block-sized arrays, nothing sized by T
    assert column[10**12 + 5] == values[3]  # the same value when read again


def test_a_long_synthetic_run_keeps_host_mates_slow_together():
    cluster = two_slow_hosts()
    iterations = MATRIX_CELLS // 4 + BLOCK  # drawn block by block
    delays = cluster.delays(iterations, 4)
    slow = delays > 3 * cluster.base_s
    assert 0.3 < slow.mean() < 0.7  # p_slow = p_recover: half the time slow
    np.testing.assert_array_equal(slow[:, 0], slow[:, 2])
    np.testing.assert_array_equal(slow[:, 1], slow[:, 3])
    assert (slow[:, 0] != slow[:, 1]).any()
    column = cluster.column(iterations, 4, 3)
    assert column.values(BLOCK - 5, BLOCK + 5).tolist() == delays[BLOCK - 5 : BLOCK + 5, 3].tolist()


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_synthetic_parameters_must_be_finite(value):
    with pytest.raises(ConfigError, match="base_s must be finite"):
        parse_stragglers(f"synthetic:base_s={value}")


# -- job: a user's job ---------------------------------------------------------------------------
def test_job_presets_describe_the_users_job_and_its_siblings():
    from bdsgd.stages.stragglers import JOB_PRESETS, JobCluster

    job = parse_stragglers("job", seed=3).inner
    assert isinstance(job, JobCluster) and job == parse_stragglers("job:slow_rank", seed=3).inner
    assert (job.device_s, job.micro_batches, job.slow_ranks, job.slow_factor) == (0.04, 4, 1, 2.5)
    assert (job.spell_s, job.spell_p, job.host_spells, job.seed) == (0.6, 0.08, False, 3)
    assert parse_stragglers("job:two_slow").inner.slow_ranks == 2
    host = parse_stragglers("job:host_spells").inner
    assert host.host_spells and host.hosts == 2
    assert parse_stragglers("job:late_slowdown").inner.slow_from == 100
    assert set(JOB_PRESETS) == {"slow_rank", "two_slow", "host_spells", "late_slowdown"}
    tuned = parse_stragglers("job:two_slow:spell_p=0.2,host_spells=1,hosts=2").inner
    assert (tuned.slow_ranks, tuned.spell_p, tuned.host_spells, tuned.hosts) == (2, 0.2, True, 2)
    assert parse_stragglers("job:sigma=0").inner.sigma == 0.0  # no preset: slow_rank's


def test_job_delays_have_the_jobs_character():
    delays = parse_stragglers("job", seed=0).delays(4000, 4)
    healthy = np.median(delays[:, 1:])
    assert healthy == pytest.approx(0.16, rel=0.02)  # 4 micro-batches of 0.04 s
    assert np.median(delays[:, 0]) == pytest.approx(2.5 * 0.16, rel=0.03)
    spells = delays[:, 1:] > 0.16 + 0.5
    assert spells.mean() == pytest.approx(0.08, abs=0.01)
    # rank spells are independent: two ranks together about 0.08^2 of the time
    assert (spells[:, 0] & spells[:, 1]).mean() < 0.02


def test_job_host_spells_hit_every_rank_of_the_host_together():
    delays = parse_stragglers("job:host_spells", seed=1).delays(2000, 4)
    spells = delays > 0.6
    assert np.array_equal(spells[:, 1], spells[:, 3])  # host1: ranks 1 and 3
    assert not np.array_equal(spells[:, 0], spells[:, 1])
    assert spells[:, 1].mean() == pytest.approx(0.08, abs=0.02)


def test_job_slowdown_starts_at_its_iteration():
    delays = parse_stragglers("job:late_slowdown:spell_p=0", seed=2).delays(200, 4)
    assert np.all(delays[:100, 0] < 0.25) and np.all(delays[100:, 0] > 0.3)
    assert np.all(delays[:, 1:] < 0.25)


def test_job_columns_are_the_delays_whatever_the_run_length():
    model = parse_stragglers("job:host_spells", seed=4, time_scale=0.5)
    short, long = model.delays(50, 4), model.delays(BLOCK + 10, 4)
    assert np.array_equal(short, long[:50])
    column = model.column(1 << 31, 4, 2)  # a training loop's column: drawn as it is read
    assert [column[t] for t in (0, 49, BLOCK + 5)] == pytest.approx(
        [long[0, 2], long[49, 2], long[BLOCK + 5, 2]]
    )
    assert model.host_of(4) == ["host0", "host1", "host0", "host1"]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("job:fast", "unknown job preset 'fast'"),
        ("job:slow_rank:nope=1", "bad job straggler parameter 'nope=1'"),
        ("job:spell_p=2", r"spell_p in \[0, 1\]"),
        ("job:slow_factor=0.5", "slow_factor >= 1"),
        ("job:micro_batches=0", "micro_batches >= 1"),
        ("job:host_spells=maybe", "host_spells needs a number"),
        ("job:seed=1", "bad job straggler parameter 'seed=1'"),
    ],
)
def test_bad_job_specs_are_config_errors(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_stragglers(spec)
