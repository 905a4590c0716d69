"""The engine's parameter server under failure and the arithmetic it promises: the update is the
mean of the admitted workers' own gradients; a worker that hangs while alive is declared dead at
the timeout and the run goes on; ``--min-workers`` ends a run that lost too many."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal

import polars as pl
import pytest
import torch
from bdsgd.stages.engine.config import EngineConfig
from bdsgd.stages.engine.launch import run_engine
from bdsgd.stages.engine.resume import STATE_FILE
from bdsgd.stages.errors import WorkerError
from bdsgd.stages.store import TraceStore
from bdsgd.stages.workloads import load_workload

from tests.stages.engine import write_replay_trace
from tests.stages.engine.test_engine import RecordingStatic, engine_config, kill_worker_at


def ps_config(**overrides) -> EngineConfig:
    values = dict(workers=3, iterations=12, run_id="failures", batch_size=8, micro_batches=2,
                  record_batch=4, hosts=("h0", "h1", "h2"))  # fmt: skip
    return engine_config(**{**values, **overrides})


def worker(name: str) -> multiprocessing.Process:
    (proc,) = [p for p in multiprocessing.active_children() if p.name == name]
    return proc


def no_worker_left() -> bool:
    return not [p for p in multiprocessing.active_children() if p.name.startswith("bdsgd-")]


# -- the update ---------------------------------------------------------------------------------
def own_gradient(cfg: EngineConfig, w: int) -> torch.Tensor:
    """Trace worker w's gradient of iteration 0, computed here from its own data stream (process
    id w + 1) at the initial parameters."""
    workload = load_workload(cfg.workload, seed=cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + w + 1)
    x, y = workload.batch(gen, cfg.batch_size)
    workload.loss(workload.model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in workload.model.parameters()])


def test_the_update_is_the_mean_of_the_admitted_workers_own_gradients(tmp_path):
    """static:2 of 3, worker 2 always cut: one SGD step without momentum or lr scaling moves the
    parameters by lr times the mean of workers 0 and 1's gradients, not 2's, not their sum."""
    replay = write_replay_trace(tmp_path / "replay", [[0.005, 0.005, 5.0]])
    cfg = ps_config(
        iterations=1, stragglers=f"replay:{replay}", lr=0.1, momentum=0.0, lr_scaling="none"
    )
    policy = RecordingStatic(2)
    run_engine(cfg, policy, tmp_path / "traces", lambda t, row: None, run_dir=tmp_path / "run")
    assert policy.observed[0][1].tolist() == [False, False, True]  # 0 and 1 admitted
    initial = load_workload(cfg.workload, seed=cfg.seed).model
    before = torch.cat([p.detach().reshape(-1) for p in initial.parameters()])
    saved = torch.load(tmp_path / "run" / STATE_FILE, weights_only=True)["model"]
    after = torch.cat([saved[k].reshape(-1) for k in initial.state_dict()])
    grads = [own_gradient(cfg, w) for w in range(3)]
    step = (before - after) / cfg.lr
    torch.testing.assert_close(step, (grads[0] + grads[1]) / 2, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(step, (grads[0] + grads[1] + grads[2]) / 3, atol=1e-4)


# -- a worker that hangs but stays alive ----------------------------------------------------------
def test_a_hung_worker_is_declared_dead_at_the_timeout_and_the_run_goes_on(tmp_path):
    """full sync (every gradient awaited); worker 1 is stopped (SIGSTOP: alive, silent) after
    iteration 2, during its 5 s delay of iteration 3 (iteration 3 is announced before 2's
    callback runs: without the delay it could be done already), and continued once the others
    carry on without it."""
    delays = [[0.001] * 3 for _ in range(12)]
    delays[3][1] = 5.0
    replay = write_replay_trace(tmp_path / "replay", delays)
    cfg = ps_config(timeout_s=10.0, stragglers=f"replay:{replay}")
    stopped: list[int] = []

    def on_iteration(t: int, row: dict) -> None:
        if t == 2:
            victim = worker("bdsgd-worker-1")
            os.kill(victim.pid, signal.SIGSTOP)
            stopped.append(victim.pid)
        elif stopped and row["workers"] == 2:
            os.kill(stopped.pop(), signal.SIGCONT)  # back, but no longer a member

    policy = RecordingStatic(3)
    try:
        result = run_engine(cfg, policy, tmp_path / "traces", on_iteration)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert result.log["iteration"] == list(range(cfg.iterations))
    assert result.dead_workers == {1: 3}
    assert result.log["c"][:3] == [3, 3, 3] and result.log["c"][3] == 2
    assert result.log["c"][4:] == [2] * (cfg.iterations - 4)
    assert policy.lives[-1].tolist() == [True, False, True]
    rows = TraceStore(tmp_path / "traces").read()
    hung = rows.filter(pl.col("worker") == 1).sort("iteration")
    assert hung["iteration"].to_list() == [0, 1, 2, 3]
    assert hung["censored"].to_list() == [False, False, False, True]
    assert rows.filter(pl.col("worker") != 1).height == 2 * cfg.iterations
    assert no_worker_left()


# -- --min-workers ------------------------------------------------------------------------------
def test_losing_more_workers_than_min_workers_allows_ends_the_run(tmp_path):
    cfg = ps_config(min_workers=3)
    with pytest.raises(WorkerError, match="only 2 worker\\(s\\) left, fewer than --min-workers 3"):
        run_engine(
            cfg,
            RecordingStatic(3),
            tmp_path / "traces",
            kill_worker_at(5, "bdsgd-worker-2"),
            run_dir=tmp_path / "run",
        )
    assert no_worker_left()
    state = torch.load(tmp_path / "run" / STATE_FILE, weights_only=True)  # what it had is kept
    assert 6 <= state["next_iteration"] <= 8
    rows = TraceStore(tmp_path / "traces").read()
    assert set(rows["iteration"].to_list()) == set(range(state["next_iteration"]))
    per_iteration = rows.filter(pl.col("worker") != 2).group_by("iteration").len()
    assert (per_iteration["len"] == 2).all()  # the survivors' rows, every iteration
