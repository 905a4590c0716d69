"""A library job's run directory is one run: one lock taken at construction, one run id from
the first iteration to the last however often it resumes, a fresh job starting afresh, and an
``out`` bdsgd did not write refused on every rank. Real ranks over gloo on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from bdsgd.stages.run_lock import RunDirLock
from bdsgd.stages.store import TraceStore

from tests.stages.loop.launch import run_ranks


def ranks_ok(results) -> None:
    for rc, out in results:
        assert rc == 0, out[-3000:]


def job(tmp_path: Path, *args: str, result: str = "r") -> list:
    run = ["--steps", "8", "--out", str(tmp_path / "run"), "--traces", str(tmp_path / "traces")]
    return run_ranks(2, *run, *args, "--result", str(tmp_path / result))


def last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_job_stopped_and_resumed_three_times_is_one_run_with_every_iteration_once(tmp_path):
    ranks_ok(job(tmp_path, "--stop-after", "2"))
    for stop in ("4", "6"):
        ranks_ok(job(tmp_path, "--resume", "--stop-after", stop))
    ranks_ok(job(tmp_path, "--resume"))
    rows = TraceStore(tmp_path / "traces").read()
    (run_id,) = rows["run_id"].unique().to_list()
    cells = sorted(zip(rows["iteration"], rows["worker"], strict=True))
    assert cells == [(t, w) for t in range(8) for w in (0, 1)]  # nothing lost, nothing twice
    log = pq.read_table(tmp_path / "run" / "iterations.parquet").to_pydict()
    assert log["iteration"] == list(range(8))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["run_id"] == run_id
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["run_id"] == run_id


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fresh_job_in_an_old_run_dir_starts_a_new_run(tmp_path):
    """Without resume, the previous run's checkpoint and log are gone once the job holds the
    lock: a new run id, iterations from 0, nothing mixed."""
    ranks_ok(job(tmp_path, "--stop-after", "3"))
    first = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["run_id"]
    ranks_ok(job(tmp_path, "--stop-after", "2", result="r2"))
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["run_id"] != first and state["next_iteration"] == 2
    log = pq.read_table(tmp_path / "run" / "iterations.parquet").to_pydict()
    assert log["iteration"] == [0, 1]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["run_id"] == state["run_id"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_on_a_run_dir_in_use_is_refused_on_every_rank_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"the live run's")
    lock = RunDirLock(run).acquire()
    try:
        before = {p.name: p.read_bytes() for p in run.iterdir()}
        results = job(tmp_path, "--resume")
        after = {p.name: p.read_bytes() for p in run.iterdir()}
    finally:
        lock.release()
    for rc, out in results:
        assert rc != 0 and "is in use by another run" in last_line(out), out[-2000:]
    assert after == before and not (tmp_path / "traces").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["file", "foreign"])
def test_an_out_bdsgd_did_not_write_is_refused_at_construction_on_every_rank(tmp_path, kind):
    run = tmp_path / "run"
    if kind == "file":
        run.write_text("a file of the user's")
    else:
        run.mkdir()
        (run / "summary.json").write_text("the user's own summary")
        (run / "notes.txt").write_text("the user's notes")
    results = job(tmp_path)
    for rc, out in results:
        expected = "is a file" if kind == "file" else "holds files bdsgd did not write"
        assert rc != 0 and expected in last_line(out), out[-2000:]
    if kind == "file":
        assert run.read_text() == "a file of the user's"
    else:
        assert (run / "summary.json").read_text() == "the user's own summary"
        assert sorted(p.name for p in run.iterdir()) == ["notes.txt", "summary.json"]
