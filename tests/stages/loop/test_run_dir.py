"""A library job's run directory is one run: one lock taken at construction, one run id from
the first iteration to the last however often it resumes, a fresh job starting afresh, and an
``out`` bdsgd did not write refused on every rank. Real ranks over gloo on loopback."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from bdsgd.stages.run_lock import RunDirLock
from bdsgd.stages.store import TraceStore

from tests.full_disk import mount_tmpfs
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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_0s_disk_filling_at_a_save_ends_every_rank_with_the_same_line(tmp_path):
    """Rank 0's checkpoint cannot be written: every rank's output ends with the same one line,
    naming rank 0 and the cause (not gloo's closed connection on the others)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not mount_tmpfs(disk, "2m"):
        pytest.skip("this machine does not let the test mount a tmpfs")
    try:
        results = run_ranks(2, "--steps", "8", "--stop-after", "2", "--out", str(disk / "run"),
                            "--traces", str(tmp_path / "traces"), "--fill", str(disk),
                            "--result", str(tmp_path / "r"))  # fmt: skip
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False, timeout=30)
    # (torch prefixes an uncaught error's lines with "[rank<r>]: ")
    lines = [re.sub(r"^\[rank\d+\]: ", "", last_line(out)) for _, out in results]
    assert all(rc != 0 for rc, _ in results)
    assert lines[0] == lines[1], lines
    assert "rank 0:" in lines[0] and "No space left on device" in lines[0], lines
