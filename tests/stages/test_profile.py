"""``run_profile`` in this process: a replayed cluster is reproduced as injected delays."""

from __future__ import annotations

import polars as pl
import pytest
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.profile import ProfileConfig, run_profile
from bdsgd.stages.store import TraceStore

from tests.stages.engine import write_replay_trace

SCALE = 0.5


def recorded(t: int, w: int) -> float:
    """Run-time of the recorded 3-worker, 3-iteration cluster: worker 1 is slow."""
    return 0.01 * (1 + t) + (0.2 if w == 1 else 0.0)


def test_replay_injects_the_recorded_run_times_scaled(tmp_path):
    replay = write_replay_trace(
        tmp_path / "recorded", [[recorded(t, w) for w in range(3)] for t in range(3)]
    )
    cfg = ProfileConfig(
        workers=4,
        iterations=7,
        traces=tmp_path / "traces",
        stragglers=f"replay:{replay}",
        time_scale=SCALE,
        batch_size=8,
        micro_batches=2,
        timeout_s=20.0,
    )
    result = run_profile(cfg)
    rows = TraceStore(cfg.traces).read().filter(pl.col("run_id") == result.run_id)
    assert rows.height == 28 and result.rows == 28
    for r in rows.iter_rows(named=True):
        expected = recorded(r["iteration"] % 3, r["worker"] % 3) * SCALE
        assert r["injected_delay_s"] == pytest.approx(expected, abs=1e-6)
        assert r["runtime_s"] >= r["injected_delay_s"]
    assert rows["host"].to_list() == [f"h{w % 3}" for w in rows["worker"]]
    assert result.per_worker["worker"].to_list() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (dict(workers=0), "--workers must be >= 1, got 0"),
        (dict(iterations=0), "--iterations must be >= 1, got 0"),
        (dict(batch_size=2, micro_batches=4), "smaller than --micro-batches"),
        (dict(timeout_s=float("nan")), "--timeout must be a finite number of seconds"),
        (dict(start_timeout_s=-1.0), "--start-timeout must be a finite number of seconds"),
    ],
)
def test_profile_config_rejects_bad_values(tmp_path, bad, needle):
    with pytest.raises(ConfigError, match=needle):
        ProfileConfig(**{"workers": 2, "iterations": 2, "traces": tmp_path, **bad})
