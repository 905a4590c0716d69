"""Start-up: the engine waits ``--start-timeout`` (not ``--timeout``) for its workers to start,
and a run that fails there names the workers that did not start or exited."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
from bdsgd.stages.engine.launch import run_engine
from bdsgd.stages.errors import WorkerError
from bdsgd.stages.policies.cutoff import StaticCutoff
from bdsgd.stages.workloads import load_workload

from tests.stages.engine.test_engine import engine_config

SLOW_WORKER = "BDSGD_TEST_SLOW_WORKER"  # "<process name>,<seconds>|raise"
WORKLOAD = "tests.stages.engine.test_start:slow_in_worker"


def slow_in_worker(seed: int = 0):
    """The mlp, built late (or failing) in the worker process the environment names."""
    name, _, action = os.environ.get(SLOW_WORKER, "").partition(",")
    if multiprocessing.current_process().name == name:
        if action == "raise":
            raise RuntimeError("this worker fails while it starts")
        time.sleep(float(action))
    return load_workload("mlp", seed=seed)


def run(tmp_path, **overrides):
    cfg = engine_config(workers=2, iterations=4, hosts=("h0", "h1"), workload=WORKLOAD,
                        engine="collective", **overrides)  # fmt: skip
    return run_engine(cfg, StaticCutoff(2), tmp_path / "traces", lambda t, row: None)


def test_start_deadline_is_its_own_not_the_timeout(tmp_path, monkeypatch):
    """A worker that takes longer to start than ``--timeout`` (a loaded machine, a shared
    filesystem) delays the run, and fails nothing."""
    monkeypatch.setenv(SLOW_WORKER, "bdsgd-worker-1,12")
    result = run(tmp_path, timeout_s=5.0, start_timeout_s=300.0)
    assert result.log["iteration"] == [0, 1, 2, 3]
    assert result.dead_workers == {}


def test_a_worker_that_does_not_start_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(SLOW_WORKER, "bdsgd-worker-1,600")
    # (worker 0 may be slow to start too on a loaded machine: then both are named)
    with pytest.raises(WorkerError, match=r"worker\(s\) (0, )?1 did not start within 3 s"):
        run(tmp_path, start_timeout_s=3.0)


def test_a_worker_that_exits_while_starting_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(SLOW_WORKER, "bdsgd-worker-0,raise")
    with pytest.raises(WorkerError, match=r"worker\(s\) 0 exited during start-up"):
        run(tmp_path)
