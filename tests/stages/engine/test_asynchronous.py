"""The engine's asynchronous mode (:func:`run_engine` with a ``k-async`` policy) with tiny
configs: exactly K gradients per update, a slow worker's gradients applied late (stale), trace
rows per computation, a worker killed mid-run."""

from __future__ import annotations

import multiprocessing
import os
import signal

import numpy as np
import polars as pl
import pytest
import torch
from bdsgd.stages.engine.launch import run_engine
from bdsgd.stages.engine.resume import STATE_FILE
from bdsgd.stages.policies.asynchronous import KAsync
from bdsgd.stages.store import TraceStore

from tests.stages.engine import engine_config as small_config
from tests.stages.engine import exit_codes_of_workers, kill_worker_at, write_replay_trace

SLOW_S, FAST_S = 0.3, 0.01


class RecordingKAsync(KAsync):
    """``k-async:K`` that keeps every observation."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.observed: list[tuple[np.ndarray, np.ndarray]] = []

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.observed.append((runtimes.copy(), censored.copy()))


def engine_config(**overrides):
    """Three workers, 24 updates (start-up of three processes on a busy 2-core machine)."""
    values = dict(workers=3, iterations=24, run_id="async-test", batch_size=8, micro_batches=2,
                  record_batch=8, timeout_s=60.0, hosts=("h0", "h1", "h2"))  # fmt: skip
    return small_config(**{**values, **overrides})


@pytest.fixture(scope="module")
def slow_worker_run(tmp_path_factory):
    """k-async:2 of 3 workers; worker 2's injected delay is 0.3 s, the others' 10 ms. An update
    takes at least FAST_S (two fast gradients, each at least FAST_S), so 72 updates last at least
    0.72 s: the slow gradient lands at least twice however fast the machine (24 could all end
    before the first one, 0.24 s)."""
    tmp = tmp_path_factory.mktemp("async")
    replay = write_replay_trace(tmp / "replay", [[FAST_S, FAST_S, SLOW_S]])
    iterations = 72
    assert iterations * FAST_S >= 2 * SLOW_S
    cfg = engine_config(stragglers=f"replay:{replay}", iterations=iterations)
    policy = RecordingKAsync(2)
    result = run_engine(cfg, policy, tmp / "traces", lambda t, row: None, run_dir=tmp / "run")
    rows = TraceStore(tmp / "traces").read().sort("worker", "iteration")
    return cfg, policy, result, rows, tmp / "run"


def test_every_update_applies_exactly_k_gradients(slow_worker_run):
    cfg, policy, result, _, _ = slow_worker_run
    assert result.log["iteration"] == list(range(cfg.iterations))
    assert result.log["c"] == [2] * cfg.iterations
    assert result.log["lr"] == pytest.approx([cfg.lr * 2 / 3] * cfg.iterations)
    assert len(policy.observed) == cfg.iterations
    for _, censored in policy.observed:
        assert (~censored).sum() == 2  # the two senders exactly, everyone else censored
    with_slow = sum(not censored[2] for _, censored in policy.observed)
    assert with_slow < cfg.iterations / 2  # the updates went on without the slow worker
    assert not result.interrupted and not result.dead_workers


def test_slow_worker_gradients_are_applied_late(slow_worker_run):
    _, policy, result, _, _ = slow_worker_run
    staleness = np.asarray(result.log["staleness"])
    with_slow = np.array([not censored[2] for _, censored in policy.observed])
    # the slow gradient was read many updates earlier; fast pairs are mostly fresh (a fast
    # worker that kept computing through the slow worker's update lands one update late). Not
    # before the fast pair runs: a worker that started first may land in the first updates
    # with a fresh gradient (seen: the slow one in update 0, its two mates starting late)
    running = int(np.argmax(~with_slow))  # the first update of two fast gradients
    late = with_slow & (np.arange(len(staleness)) >= running + 2)
    assert late.any()
    assert (staleness[late] >= 2).all()
    assert staleness[late].min() > staleness[~with_slow].max()
    assert np.median(staleness[~with_slow]) == 0


def test_trace_rows_are_one_per_computation(slow_worker_run):
    cfg, _, result, rows, _ = slow_worker_run
    assert rows["source"].unique().to_list() == ["train"]
    assert rows["policy"].unique().to_list() == ["k-async:2"]
    assert rows["cutoff"].unique().to_list() == [2]
    for w in range(cfg.workers):
        mine = rows.filter(pl.col("worker") == w)
        assert mine["iteration"].to_list() == list(range(mine.height))  # j = 0, 1, 2, ...
        assert not mine["censored"][:-1].any()  # only the last one may have been cut short
    finished = rows.filter(~pl.col("censored"))
    applied = sum(result.log["c"])
    assert applied <= finished.height <= applied + cfg.workers  # + those that came too late
    slow = finished.filter(pl.col("worker") == 2)
    assert slow.height >= 1 and (slow["runtime_s"] >= SLOW_S).all()
    assert slow["injected_delay_s"].to_list() == pytest.approx([SLOW_S] * slow.height)
    assert result.rows_written == rows.height


def test_async_engine_state_loads_with_weights_only(slow_worker_run):
    cfg, _, result, rows, run_dir = slow_worker_run
    state = torch.load(run_dir / STATE_FILE, weights_only=True)
    assert state["engine"] == "async" and state["next_iteration"] == cfg.iterations
    assert state["log"]["staleness"] == result.log["staleness"]
    written = rows.group_by("worker").agg(pl.len()).sort("worker")["len"].to_list()
    assert state["next_j"] == written


@pytest.fixture(scope="module")
def killed_worker_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async-killed")
    cfg = engine_config(iterations=30, stragglers="synthetic:base_s=0.01")
    policy = RecordingKAsync(3)
    result = run_engine(cfg, policy, tmp / "traces", kill_worker_at(8, "bdsgd-worker-1"))
    return cfg, result, TraceStore(tmp / "traces").read()


def test_async_run_survives_a_killed_worker(killed_worker_run):
    cfg, result, rows = killed_worker_run
    assert result.log["iteration"] == list(range(cfg.iterations))
    assert list(result.dead_workers) == [1]
    assert 8 <= result.dead_workers[1] <= 10
    assert result.log["workers"][-1] == 2 and result.log["c"][-1] == 2  # K capped to the live
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("bdsgd-")]
    dead = rows.filter(pl.col("worker") == 1).sort("iteration")
    assert dead["iteration"].to_list() == list(range(dead.height))
    assert dead.height <= 11 and dead["censored"][-1]  # its last computation never finished
    assert dead["start_s"].is_sorted()  # the server's censored row on the workers' clock


def test_ctrl_c_after_an_update_records_that_update_and_nothing_after(tmp_path, monkeypatch):
    """Ctrl-C right after the server applied update 10 (while it tells the policy): update 10
    is recorded (its parameters are those the checkpoint holds, so a resumed run must not
    apply it again), no update after it, and every worker stops on its own."""
    updates = []

    class Interrupting(RecordingKAsync):
        def observe(self, runtimes, censored):
            super().observe(runtimes, censored)
            updates.append(int((~censored).sum()))
            if len(updates) == 11:
                os.kill(os.getpid(), signal.SIGINT)  # (the handler runs before this returns)

    codes = exit_codes_of_workers(monkeypatch)
    cfg = engine_config(iterations=400, stragglers="synthetic:base_s=0.002")
    result = run_engine(cfg, Interrupting(2), tmp_path / "traces", lambda t, r: None,
                        tmp_path / "run")  # fmt: skip
    assert result.interrupted and result.log["iteration"] == list(range(11))
    assert len(updates) == 11
    assert len(codes) == cfg.workers and all(c is not None and c >= 0 for c in codes), codes
