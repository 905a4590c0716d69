"""``bdsgd train`` and ``bdsgd profile`` on the library's loop: the command line as a client of the library. Real ranks
over gloo on loopback, spawned by the command (which is no rank); every test reaps its session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import torch
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.loop_runs import check_loop_flags, loop_job
from bdsgd.stages.store import TraceStore
from bdsgd.stages.train import TrainConfig

from tests.cli.test_train_cli import listening_addresses, running, session_of
from tests.processes import finish_sessions, kill_session, start_in_session, stderr_of
from tests.stages.loop.adamw_workload import warmup_cosine

BDSGD = str(Path(sys.executable).with_name("bdsgd"))
ROOT = Path(__file__).resolve().parents[2]
ADAMW = "tests.stages.loop.adamw_workload:adamw"
WAIT_S = 240.0  # a whole short run on a loaded machine (start-up imports torch in every rank)


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    return start_in_session(
        [BDSGD, *args], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})},
    )  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = WAIT_S) -> tuple[int, str, str]:
    (done,) = finish_sessions(proc, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def train(tmp: Path, *extra: str, name: str = "run", env=None) -> tuple[int, str, str]:
    args = ["train", "--workers", "2", "--policy", "full",
            "--workload", ADAMW, "--batch-size", "8", "--micro-batches", "2", "--lr", "0.01",
            "--traces", str(tmp / "traces"), "--out", str(tmp / name), *extra]  # fmt: skip
    return finish(start(*args, env=env))


def checkpoint(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=True)


@pytest.mark.timeout(600)
def test_train_on_loop_trains_every_rank_with_the_workloads_optimizer_and_schedule(tmp_path):
    rc, _, err = train(tmp_path, "--iterations", "12")
    assert rc == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["engine"] == "loop" and summary["world_size"] == 2  # no rank coordinates
    assert summary["iterations"] == 12 and summary["stopped"] == "iterations"
    rows = TraceStore(tmp_path / "traces").read()
    assert rows.height == 24 and not rows["censored"].any()
    state = checkpoint(tmp_path / "run")
    assert state["next_iteration"] == 12 and state["scheduler"]["last_epoch"] == 12
    moments = state["optimizer"]["state"]
    assert moments and all("exp_avg_sq" in s for s in moments.values())  # AdamW's
    lrs = pl.read_parquet(tmp_path / "run" / "iterations.parquet")["lr"].to_list()
    assert lrs == pytest.approx([0.01 * warmup_cosine(t) for t in range(12)], rel=1e-6)


@pytest.mark.timeout(900)
def test_a_run_interrupted_mid_way_resumes_to_the_state_of_an_uninterrupted_one(tmp_path):
    """Ctrl-C (the command's SIGTERM relay) after the first checkpoint (iteration 25): the ranks
    stop together and save; then --resume: the model,
    AdamW's moments and the schedule end where a run without the interruption ends."""
    rc, _, err = train(tmp_path, "--iterations", "60", name="straight")
    assert rc == 0, err
    proc = start("train", "--workers", "2", "--policy", "full",
                 "--workload", ADAMW, "--batch-size", "8", "--micro-batches", "2", "--lr", "0.01",
                 "--traces", str(tmp_path / "traces2"), "--out", str(tmp_path / "cut"),
                 "--iterations", "60",
                 "--stragglers", "synthetic:base_s=0.05,sigma=0,spike_p=0")  # fmt: skip
    try:
        deadline = time.monotonic() + WAIT_S
        while not (tmp_path / "cut" / "checkpoint.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, stderr_of(proc)
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        rc, _, err = finish(proc, 60)
    finally:
        kill_session(proc)
    assert rc != 0 and checkpoint(tmp_path / "cut")["next_iteration"] < 60, err
    ended = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert ended["stopped"] == "interrupted" and not ended["complete"]
    # every rank stopped after the same iteration and the checkpoint was saved there
    stopped_at = checkpoint(tmp_path / "cut")["next_iteration"]
    assert stopped_at > 25 and ended["iterations"] == stopped_at
    rc, _, err = finish(start("train", "--resume", str(tmp_path / "cut"), "--workload", ADAMW))
    assert rc == 0, err
    a, b = checkpoint(tmp_path / "straight"), checkpoint(tmp_path / "cut")
    assert b["next_iteration"] == 60 and b["scheduler"] == a["scheduler"]
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, rtol=0, atol=1e-6)
    wall = pl.read_parquet(tmp_path / "cut" / "iterations.parquet").sort("iteration")["wall_s"]
    assert wall.is_sorted() and wall.len() == 60  # the clock goes on across the resume
    rows = TraceStore(tmp_path / "traces2").read()
    assert sorted(zip(rows["iteration"], rows["worker"], strict=True)) == [
        (t, w) for t in range(60) for w in range(2)
    ]  # nothing missing, nothing twice


@pytest.mark.timeout(600)
def test_a_rank_that_fails_ends_the_run_with_one_line_naming_it_and_no_process_left(tmp_path):
    proc = start("train", "--workers", "2", "--policy", "static:1",
                 "--workload", ADAMW, "--batch-size", "8", "--iterations", "40",
                 "--traces", str(tmp_path / "traces"), "--out", str(tmp_path / "run"),
                 env={"ADAMW_FAIL_AT": "1:5"})  # fmt: skip
    try:
        _, err = proc.communicate(timeout=WAIT_S)
        left = [p for p in session_of(proc.pid) if running(p)]  # before the test reaps any
    finally:
        kill_session(proc)
    assert proc.returncode != 0
    assert err.strip().splitlines()[-1] == (
        "error: rank 1: RuntimeError: rank 1: the data pipeline broke at batch 5"
    ), err  # the first failed rank's own error, in one line (rank 0's broken group: not it)
    assert "Traceback" not in err
    assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]


@pytest.mark.timeout(600)
def test_profile_on_loop_measures_every_rank_and_listens_on_loopback_alone(tmp_path):
    proc = start("profile", "--workers", "2", "--iterations", "400",
                 "--traces", str(tmp_path / "traces"), "--batch-size", "8",
                 "--stragglers", "synthetic:base_s=0.01")  # fmt: skip
    try:
        deadline = time.monotonic() + WAIT_S
        listening: list = []
        while len(listening) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the store, and each rank's gloo listener once they are up
            listening = listening_addresses(session_of(proc.pid))
        rc, _, err = finish(proc)
    finally:
        kill_session(proc)
    assert rc == 0, err
    assert len(listening) >= 3 and {a for a, _ in listening} == {"127.0.0.1"}, listening
    rows = TraceStore(tmp_path / "traces").read()
    assert rows.height == 800 and set(rows["source"]) == {"profile"}
    assert not rows["censored"].any() and set(rows["worker"]) == {0, 1}


def config(tmp_path, **values) -> TrainConfig:
    base = dict(workers=2, iterations=10, policy="full", traces=tmp_path / "t",
                out=tmp_path / "o")  # fmt: skip
    return TrainConfig(**{**base, **values})


@pytest.mark.parametrize(
    ("values", "flag"),
    [
        ({"min_workers": 2, "workers": 3}, "--min-workers"),
    ],
)
def test_what_the_loop_does_not_do_is_refused_in_one_line(tmp_path, values, flag):
    with pytest.raises(ConfigError, match=flag):
        check_loop_flags(config(tmp_path, **values))


def test_the_job_carries_the_train_flags_to_the_library(tmp_path):
    cfg = config(tmp_path, salvage=True, lr_scaling="sqrt", target_loss=0.5,
                 stop_at_target=True, explore=0.1, overhead_s=0.002, max_wall_s=9.0)  # fmt: skip
    job = loop_job(cfg, "run-x", cfg.policy, cfg.out)
    assert job.max_wall_s == 9.0
    assert (job.loop.salvage, job.loop.lr_scaling, job.loop.run_id) == (True, "sqrt", "run-x")
    assert (job.loop.explore, job.loop.overhead_s, job.stop_at) == (0.1, 0.002, 0.5)
    assert job.loop.out == str(cfg.out) and job.iterations == 10


@pytest.mark.timeout(300)
def test_a_workload_with_its_own_optimizer_is_refused_by_the_parameter_server(tmp_path):
    rc, _, err = finish(start("train", "--workers", "2", "--policy", "async", "--workload",
                              ADAMW, "--iterations", "5", "--traces", str(tmp_path / "t"),
                              "--out", str(tmp_path / "o")))  # fmt: skip
    assert rc != 0 and "train it with a synchronous policy" in err.strip().splitlines()[-1], err
    assert not (tmp_path / "o").exists() and not (tmp_path / "t").exists()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("flags", "stopped"),
    [
        (("--target-loss", "100", "--stop-at-target"), "target"),
        (("--max-wall-s", "1e-6"), "wall budget"),
    ],
)
def test_a_loop_run_stops_early_on_every_rank_together(tmp_path, flags, stopped):
    """A target reached or a wall budget spent ends the run after the same iteration on both
    ranks (each would otherwise wait for the other in the all-reduce until the timeout)."""
    rc, _, err = train(tmp_path, "--iterations", "200", "--timeout", "120", *flags)
    assert rc == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped"] == stopped and summary["iterations"] < 200
    assert checkpoint(tmp_path / "run")["next_iteration"] == summary["iterations"]


@pytest.mark.timeout(900)
def test_a_rank_killed_mid_run_restarts_the_job_and_nothing_is_lost_or_doubled(tmp_path):
    """SIGKILL to one rank once the first checkpoint is written: the job restarts from it
    (--max-restarts 1, the default) and ends with every iteration once, in the traces and in
    the iteration log, under one run id."""
    from tests.cli.test_train_cli import children_of, wait_until

    iterations = 300
    proc = start("train", "--workers", "2", "--policy", "static:1", "--iterations",
                 str(iterations), "--stragglers", "synthetic:base_s=0.02", "--batch-size", "8",
                 "--traces", str(tmp_path / "traces"), "--out", str(tmp_path / "run"))  # fmt: skip
    try:
        checkpoint = tmp_path / "run" / "checkpoint.pt"
        wait_until(lambda: checkpoint.exists() or proc.poll() is not None, 600, "a checkpoint")
        ranks = [p for p in children_of(proc.pid) if running(p) and "spawn_main" in cmdline(p)]
        assert ranks and proc.poll() is None, stderr_of(proc)
        os.kill(ranks[-1], signal.SIGKILL)
        rc, _, err = finish(proc)
    finally:
        kill_session(proc)
    assert rc == 0, err
    assert "the job restarts from its last checkpoint (restart 1 of 1)" in " ".join(err.split())
    rows = TraceStore(tmp_path / "traces").read()
    assert rows["run_id"].n_unique() == 1
    cells = sorted(zip(rows["iteration"], rows["worker"], strict=True))
    assert cells == [(t, w) for t in range(iterations) for w in (0, 1)]
    log = pl.read_parquet(tmp_path / "run" / "iterations.parquet")
    assert log["iteration"].to_list() == list(range(iterations))


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.timeout(900)
def test_a_profile_and_a_train_write_rows_of_the_same_columns_and_meanings(tmp_path):
    """The same --stragglers under profile (full) and train (static:2): the same columns in
    the same order and types, and column by column the same meanings: a rank's host, device,
    world size, workload, batch size and injected delay agree cell by cell; only the policy,
    the source, the cutoff and the cut ranks' censoring differ, as the policies did."""
    spec = "synthetic:base_s=0.01,hosts=2"
    common = ["--workers", "3", "--iterations", "6", "--stragglers", spec, "--seed", "0",
              "--batch-size", "8"]  # fmt: skip
    rc, _, err = finish(start("profile", *common, "--traces", str(tmp_path / "p")))
    assert rc == 0, err
    rc, _, err = finish(start("train", *common, "--policy", "static:2", "--traces",
                              str(tmp_path / "t"), "--out", str(tmp_path / "run")))  # fmt: skip
    assert rc == 0, err
    prof = TraceStore(tmp_path / "p").read().sort("iteration", "worker")
    train = TraceStore(tmp_path / "t").read().sort("iteration", "worker")
    assert prof.columns == train.columns and prof.dtypes == train.dtypes
    assert prof.height == train.height == 18
    for column in ("iteration", "worker", "host", "world_size", "workload", "batch_size",
                   "device", "injected_delay_s"):  # fmt: skip
        assert prof[column].to_list() == train[column].to_list(), column
    assert set(prof["batch_size"]) == {8} and set(prof["world_size"]) == {3}
    assert set(zip(prof["policy"], prof["source"], strict=True)) == {("full", "profile")}
    assert set(zip(train["policy"], train["source"], strict=True)) == {("static:2", "train")}
    assert prof["cutoff"].is_null().all() and set(train["cutoff"]) == {2}
    assert not prof["censored"].any()
    per_iteration = train.group_by("iteration").agg(pl.col("censored").sum())["censored"]
    assert all(n <= 1 for n in per_iteration)  # (a ticket taken before the close is admitted)
    for frame in (prof, train):
        assert (frame["start_s"] >= 0).all() and (frame["runtime_s"] > 0).all()
