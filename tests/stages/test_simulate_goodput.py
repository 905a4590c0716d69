"""``simulate --noise-scale``: the schedule, what the policies are fed, and the goodput metric."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from bdsgd.schemas.run_dir import iterations_table, write_run_dir
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.goodput import NoiseSchedule, gain
from bdsgd.stages.policies.base import Policy
from bdsgd.stages.simulate import SimulateConfig, compare, replay, run_simulate
from bdsgd.stages.store import RunMatrix


def lognormal_run(rows: int = 200, workers: int = 8, seed: int = 0) -> RunMatrix:
    x = np.random.default_rng(seed).lognormal(np.log(0.05), 0.1, (rows, workers))
    full = np.ones(x.shape, dtype=bool)
    return RunMatrix("run", x, ~full, full, tuple(f"h{w % 2}" for w in range(workers)))


def train_run_dir(path: Path, noise: list, batch_size: int | None = 16) -> Path:
    """A run directory as train writes it, with a noise_scale column (None: not yet known)."""
    n = len(noise)
    columns = {
        "policy": ["ewma"] * n,
        "iteration": list(range(n)),
        "wall_s": [float(t) for t in range(n)],
        "iteration_s": [1.0] * n,
        "c": [4] * n,
        "workers": [4] * n,
        "decision_ms": [0.1] * n,
        "noise_scale": noise,
    }
    write_run_dir(path, {"kind": "train"}, iterations_table(columns))
    if batch_size is not None:
        (path / "config.json").write_text(json.dumps({"batch_size": batch_size}))
    return path


def test_constant_schedule():
    schedule = NoiseSchedule.from_spec("500")
    assert schedule(0) == schedule(10_000) == 500.0 and schedule.batch_size == 32
    assert NoiseSchedule.from_spec("inf", 8).gain(3, 4) == 4.0
    assert schedule.gain(0, 4) == pytest.approx(gain(4, 500.0, 32))


def test_schedule_from_a_train_run_is_filled_by_iteration(tmp_path):
    run_dir = train_run_dir(tmp_path / "run", [None, None, 10.0, None, 40.0])
    schedule = NoiseSchedule.from_spec(str(run_dir / "iterations.parquet"))
    assert [schedule(t) for t in range(7)] == [10.0, 10.0, 10.0, 10.0, 40.0, 40.0, 40.0]
    assert schedule.batch_size == 16  # from the run's config.json
    assert NoiseSchedule.from_spec(str(run_dir), batch_size=64).batch_size == 64


@pytest.mark.parametrize(
    ("spec", "message"),
    [("-3", ">= 0"), ("nope", "neither a number"), ("{none}", "no noise_scale values")],
)
def test_bad_schedules_are_one_line_errors(tmp_path, spec, message):
    train_run_dir(tmp_path / "none", [None, None])
    with pytest.raises(ConfigError, match=message) as err:
        NoiseSchedule.from_spec(spec.format(none=tmp_path / "none"))
    assert "\n" not in str(err.value)


def test_a_run_without_the_column_is_refused(tmp_path):
    columns = {k: [0] for k in ("iteration", "c", "workers")}
    columns |= {"policy": ["full"], "wall_s": [1.0], "iteration_s": [1.0], "decision_ms": [0.0]}
    write_run_dir(tmp_path / "old", {"kind": "train"}, iterations_table(columns))
    table = pq.read_table(tmp_path / "old" / "iterations.parquet").drop(["noise_scale"])
    pq.write_table(table, tmp_path / "old" / "iterations.parquet")
    with pytest.raises(ConfigError, match="no noise_scale column"):
        NoiseSchedule.from_spec(str(tmp_path / "old"))


class NoiseRecorder(Policy):
    """Waits for everyone; records the noise scale it holds at each choose()."""

    def __init__(self) -> None:
        self.name = "recorder"
        self.seen: list[tuple[float | None, int]] = []

    def choose(self, live: np.ndarray) -> int:
        self.seen.append((self.noise_scale, self.batch_size))
        return int(live.sum())

    def observe(self, runtimes, censored) -> None:
        """Nothing to learn."""


def test_every_sync_iteration_gets_its_noise_scale_before_choosing():
    schedule = NoiseSchedule(np.array([1.0, 2.0, 3.0]), batch_size=8)
    policy = NoiseRecorder()
    result = replay(policy, lognormal_run(rows=5, workers=4), 1, 0.0, schedule)
    assert policy.seen == [(2.0, 8), (3.0, 8), (3.0, 8), (3.0, 8)]  # from row 1 on
    assert result.columns["noise_scale"] == [2.0, 3.0, 3.0, 3.0]
    assert result.columns["gain"] == pytest.approx([gain(4, b, 8) for b in (2.0, 3.0, 3.0, 3.0)])


def goodput_compare(noise: str) -> dict:
    config = SimulateConfig(traces=Path("x"), noise_scale=noise, batch_size=32)
    metrics, _ = compare(["full", "ewma", "ewma:goodput", "k-async:4"], lognormal_run(), config)
    return metrics


def test_low_noise_goodput_waits_for_fewer_and_makes_more_progress():
    metrics = goodput_compare("8")  # phi = 1/4: a few gradients are nearly as good as eight
    plain, good = metrics["ewma"], metrics["ewma:goodput"]
    assert good["mean_c"] < plain["mean_c"] and good["goodput"] > plain["goodput"]
    assert good["throughput"] < plain["throughput"]  # it gives throughput up for progress
    assert "goodput" not in metrics["k-async:4"]  # stale gradients: no gain to count


def test_high_noise_goodput_chooses_as_throughput_does():
    metrics = goodput_compare("1e12")
    plain, good = metrics["ewma"], metrics["ewma:goodput"]
    assert good["mean_c"] == plain["mean_c"] and good["throughput"] == plain["throughput"]
    assert good["goodput"] == pytest.approx(plain["throughput"], rel=1e-6)  # gain(c) = c


def test_goodput_is_gain_over_time():
    run = lognormal_run(rows=20)
    result = replay(NoiseRecorder(), run, 0, 0.5, NoiseSchedule(np.array([64.0]), 32))
    seconds = run.runtimes.max(axis=1) + 0.5
    assert result.metrics(1.0)["goodput"] == pytest.approx(gain(8, 64.0, 32) * 20 / seconds.sum())


def test_run_directory_records_noise_and_the_best_goodput(tmp_path, monkeypatch):
    monkeypatch.setattr("bdsgd.stages.simulate.load_run", lambda config: lognormal_run())
    noise = train_run_dir(tmp_path / "train", [None] + [8.0] * 99, batch_size=32)
    config = SimulateConfig(
        traces=tmp_path / "t",
        out=tmp_path / "out",
        policies=("ewma", "ewma:goodput"),
        noise_scale=str(noise),
    )
    summary = run_simulate(config)
    assert summary["best_goodput"] == "ewma:goodput" and summary["best"] == "ewma"
    table = pq.read_table(tmp_path / "out" / "iterations.parquet").to_pydict()
    assert set(table["noise_scale"]) == {8.0}
    assert all(
        g is not None and 1.0 <= g <= c for g, c in zip(table["gain"], table["c"], strict=True)
    )
    plain = run_simulate(SimulateConfig(traces=tmp_path / "t", policies=("ewma",)))
    assert "best_goodput" not in plain and "goodput" not in plain["policies"]["ewma"]
