"""bdsgd report reads run directories (schemas/run_dir.py) and writes PNGs and index.md."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
from bdsgd.schemas.run_dir import iterations_table, write_run_dir
from bdsgd.stages.errors import BdsgdError, ConfigError
from bdsgd.stages.report import ReportConfig, kaplan_meier, rolling_throughput, run_report
from bdsgd.stages.store import TraceStore

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
N, T = 4, 12


def _write_traces(store: Path, run_id: str) -> None:
    rng = np.random.default_rng(0)
    rows: dict[str, list] = {
        k: []
        for k in (
            "run_id",
            "iteration",
            "worker",
            "host",
            "world_size",
            "start_s",
            "runtime_s",
            "censored",
            "cutoff",
            "policy",
            "source",
        )
    }
    for t in range(T):
        for w in range(N):
            censored = w == N - 1 and t % 2 == 0
            rows["run_id"].append(run_id)
            rows["iteration"].append(t)
            rows["worker"].append(w)
            rows["host"].append(f"h{w // 2}")
            rows["world_size"].append(N)
            rows["start_s"].append(0.1 * t)
            rows["runtime_s"].append(float(0.05 + rng.exponential(0.02)))
            rows["censored"].append(censored)
            rows["cutoff"].append(N - 1 if t % 2 == 0 else None)
            rows["policy"].append("bdsgd")
            rows["source"].append("train")
    TraceStore(store).append(rows)


def _iterations(policy: str, with_loss: bool, with_pred: bool) -> dict[str, list]:
    secs = [0.1 + 0.01 * (t % 3) for t in range(T)]
    cols: dict[str, list] = {
        "policy": [policy] * T,
        "iteration": list(range(T)),
        "iteration_s": secs,
        "wall_s": list(np.cumsum(secs)),
        "c": [N - 1 if t % 2 == 0 else N for t in range(T)],
        "workers": [N] * T,
        "decision_ms": [0.5 + 0.1 * t for t in range(T)],
    }
    if with_loss:
        cols["loss"] = [2.0 / (1 + t) for t in range(T)]
    if with_pred:
        cols["pred_q10"] = [s * 0.8 for s in secs]
        cols["pred_q50"] = secs
        cols["pred_q90"] = [s * 1.2 for s in secs]
    return cols


@pytest.fixture
def train_dir(tmp_path: Path) -> Path:
    store = tmp_path / "traces"
    _write_traces(store, "train-1")
    summary = {
        "kind": "train",
        "traces": str(store),
        "run_id": "train-1",
        "policy": "bdsgd",
        "iterations": T,
        "wall_s": 1.3,
        "throughput": 31.5,
        "mean_c": 3.5,
        "final_loss": 0.15,
        "time_to_loss": 0.6,
        "decision_ms_p50": 0.9,
        "decision_ms_p99": 1.6,
        "target_loss": 0.3,
    }
    out = tmp_path / "train-run"
    write_run_dir(out, summary, iterations_table(_iterations("bdsgd", True, True)))
    return out


@pytest.fixture
def simulate_dir(tmp_path: Path) -> Path:
    cols = {
        k: _iterations("full", False, False)[k] + _iterations("oracle", False, False)[k]
        for k in _iterations("full", False, False)
    }
    summary = {
        "kind": "simulate",
        "traces": str(tmp_path / "missing-store"),
        "workers": N,
        "iterations": T,
        "policies": {
            "full": {"throughput": 30.0, "oracle_ratio": 0.8, "mean_c": 4.0, "decision_ms": 0.01},
            "oracle": {"throughput": 37.5, "oracle_ratio": 1.0, "mean_c": 3.5, "decision_ms": 0.02},
        },
    }
    out = tmp_path / "sim-run"
    write_run_dir(out, summary, iterations_table(cols))
    return out


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert mpimg.imread(path).shape[0] > 10


def test_report_overlays_train_and_simulate_runs(train_dir, simulate_dir, tmp_path):
    out = tmp_path / "report"
    result = run_report(ReportConfig(run_dirs=(train_dir, simulate_dir), out=out))
    names = {p.name for p in result.plots}
    assert {
        "cutoff.png",
        "throughput.png",
        "loss.png",
        "heatmap.png",
        "cdf.png",
        "prediction.png",
        "decision_ms.png",
    } == names
    for p in result.plots:
        _assert_png(p)
    index = result.index.read_text()
    for p in result.plots:
        assert f"]({p.name})" in index
    assert "| bdsgd | 31.5 |" in index  # the train summary's throughput, not a recomputed one
    assert "oracle_ratio" in index and "| oracle | 37.5 | 1 |" in index
    assert any("missing-store" in w for w in result.warnings)  # simulate traces absent: warned
    assert not list(out.glob(".tmp-*"))


def test_report_without_loss_skips_loss_plot(simulate_dir, tmp_path):
    result = run_report(ReportConfig(run_dirs=(simulate_dir,), out=tmp_path / "r"))
    names = {p.name for p in result.plots}
    assert "loss.png" not in names and "heatmap.png" not in names
    assert len(names) >= 3
    assert "loss.png" not in result.index.read_text()
    assert (
        "| idle_fraction (share of worker-s) |" not in result.index.read_text()
    )  # column only when present


def test_non_run_dir_is_one_line_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(BdsgdError, match="not a bdsgd run directory") as info:
        run_report(ReportConfig(run_dirs=(tmp_path / "empty",), out=tmp_path / "r"))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "r").exists()  # nothing written for a bad input


def test_empty_run_is_error(tmp_path):
    cols = {k: [] for k in _iterations("full", False, False)}
    write_run_dir(tmp_path / "run", {"kind": "simulate", "traces": "x"}, iterations_table(cols))
    with pytest.raises(BdsgdError, match="no iterations"):
        run_report(ReportConfig(run_dirs=(tmp_path / "run",), out=tmp_path / "r"))


def test_config_needs_a_run_dir(tmp_path):
    with pytest.raises(ConfigError, match="at least one"):
        ReportConfig(run_dirs=(), out=tmp_path)


def test_kaplan_meier_counts_censored_as_at_risk():
    # 4 run-times, the largest censored: S drops by 1/4, 1/3, 1/2 at the three finished ones
    t, f = kaplan_meier(np.array([3.0, 1.0, 2.0, 4.0]), np.array([False, False, False, True]))
    np.testing.assert_allclose(t, [1.0, 2.0, 3.0])
    np.testing.assert_allclose(f, [0.25, 0.5, 0.75])
    # censored early: the later finished times carry more mass than a naive ECDF gives them
    t, f = kaplan_meier(np.array([1.0, 2.0, 3.0]), np.array([True, False, False]))
    np.testing.assert_allclose(f, [0.5, 1.0])


def test_rolling_throughput_window():
    c = np.array([4, 4, 2, 2])
    s = np.array([1.0, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(rolling_throughput(c, s, 2), [4.0, 4.0, 3.0, 2.0])
    np.testing.assert_allclose(rolling_throughput(c, s, 10), [4.0, 4.0, 10 / 3, 3.0])


def test_noise_scale_plot_and_goodput_when_the_run_logged_them(tmp_path):
    cols = _iterations("bdsgd:goodput", True, False)
    cols["noise_scale"] = [None, float("inf")] + [10.0 * (t + 1) for t in range(T - 2)]
    cols["gain"] = [1.0] * T  # one one-worker step per iteration
    write_run_dir(tmp_path / "run", {"kind": "train"}, iterations_table(cols))
    result = run_report(ReportConfig(run_dirs=(tmp_path / "run",), out=tmp_path / "r"))
    assert tmp_path / "r" / "noise_scale.png" in result.plots
    _assert_png(tmp_path / "r" / "noise_scale.png")
    goodput = T / sum(cols["iteration_s"])
    assert "| goodput (one-worker steps/s) |" in result.index.read_text()
    assert f"{goodput:.4g}" in result.index.read_text()


def test_runs_written_before_the_noise_columns_still_report(simulate_dir, tmp_path):
    import pyarrow.parquet as pq

    path = simulate_dir / "iterations.parquet"
    pq.write_table(pq.read_table(path).drop(["noise_scale", "gain"]), path)
    result = run_report(ReportConfig(run_dirs=(simulate_dir,), out=tmp_path / "r"))
    assert "noise_scale.png" not in {p.name for p in result.plots}
    assert "| goodput (one-worker steps/s) |" not in result.index.read_text()


def _foreign_dir(path: Path) -> dict[str, bytes]:
    """A user's directory holding files with report's names; returns what they hold."""
    path.mkdir()
    files = {"index.md": b"# my notes\n", "other.txt": b"keep me\n", "cutoff.png": b"mine"}
    for name, data in files.items():
        (path / name).write_bytes(data)
    return files


def test_non_empty_out_not_written_by_report_is_refused_untouched(simulate_dir, tmp_path):
    out = tmp_path / "mine"
    files = _foreign_dir(out)
    with pytest.raises(ConfigError, match="not empty and not an earlier report") as info:
        run_report(ReportConfig(run_dirs=(simulate_dir,), out=out))
    assert "\n" not in str(info.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files  # nothing added or replaced


def test_out_is_checked_before_the_run_dirs_are_read(tmp_path):
    (tmp_path / "empty").mkdir()
    _foreign_dir(tmp_path / "mine")
    with pytest.raises(ConfigError, match="--out"):  # not the run directory's error
        run_report(ReportConfig(run_dirs=(tmp_path / "empty",), out=tmp_path / "mine"))


def test_an_earlier_reports_out_is_rewritten(train_dir, simulate_dir, tmp_path):
    out = tmp_path / "report"
    run_report(ReportConfig(run_dirs=(simulate_dir,), out=out))
    assert json.loads((out / "report.json").read_text())["kind"] == "report"
    result = run_report(ReportConfig(run_dirs=(train_dir, simulate_dir), out=out))
    assert "loss.png" in {p.name for p in result.plots}  # the second report's plots
    assert "`train-run`" in result.index.read_text()
    assert not list(out.glob(".tmp-*"))


def test_an_empty_out_is_used(simulate_dir, tmp_path):
    (tmp_path / "r").mkdir()
    result = run_report(ReportConfig(run_dirs=(simulate_dir,), out=tmp_path / "r"))
    assert result.index.is_file() and (tmp_path / "r" / "report.json").is_file()
