"""The engine in this process (:func:`run_engine`) with tiny configs: admission of exactly c
gradients, stragglers cut off and censored, learning-rate scaling, a worker killed between
iterations and one killed mid-iteration."""

from __future__ import annotations

import math
import multiprocessing
import threading

import numpy as np
import polars as pl
import pytest
import torch
from bdsgd.stages.engine.base import ServerModel
from bdsgd.stages.engine.config import EngineConfig, scaled_lr
from bdsgd.stages.engine.launch import run_engine
from bdsgd.stages.engine.resume import STATE_FILE
from bdsgd.stages.policies.cutoff import StaticCutoff
from bdsgd.stages.store import TraceStore
from bdsgd.stages.workloads import load_workload

from tests.stages.engine import exit_codes_of_workers, sigint_after, write_replay_trace

SLOW_S, FAST_S = 5.0, 0.005  # a slow worker is always cut: its long delay costs nothing


class RecordingStatic(StaticCutoff):
    """``static:C`` that keeps every observation and every live mask it was given."""

    def __init__(self, c: int) -> None:
        super().__init__(c)
        self.observed: list[tuple[np.ndarray, np.ndarray]] = []
        self.lives: list[np.ndarray] = []

    def choose(self, live: np.ndarray) -> int:
        self.lives.append(live.copy())
        return super().choose(live)

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.observed.append((runtimes.copy(), censored.copy()))


def engine_config(**overrides) -> EngineConfig:
    values = dict(
        workers=4,
        iterations=16,
        run_id="engine-test",
        source="train",
        engine="ps",
        batch_size=16,
        micro_batches=4,
        record_batch=5,
        timeout_s=20.0,
        hosts=("h0", "h1", "h2", "h3"),
    )
    return EngineConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def slow_worker_run(tmp_path_factory):
    """static:3 of 4 workers; worker 1's injected delay is 5 s, the others' 5 ms."""
    tmp = tmp_path_factory.mktemp("slow")
    replay = write_replay_trace(tmp / "replay", [[FAST_S, SLOW_S, FAST_S, FAST_S]] * 4)
    cfg = engine_config(stragglers=f"replay:{replay}")
    policy = RecordingStatic(3)
    result = run_engine(cfg, policy, tmp / "traces", lambda t, row: None, run_dir=tmp / "run")
    rows = TraceStore(tmp / "traces").read()
    return cfg, policy, result, rows, tmp / "run"


def test_every_iteration_applies_exactly_c_gradients(slow_worker_run):
    cfg, _, result, _, _ = slow_worker_run
    assert result.log["iteration"] == list(range(cfg.iterations))
    assert result.log["c"] == [3] * cfg.iterations
    assert not result.interrupted and not result.dead_workers


def test_slow_worker_is_cut_off_and_censored_in_the_traces(slow_worker_run):
    cfg, _, _, rows, _ = slow_worker_run
    assert rows.height == cfg.iterations * cfg.workers
    slow = rows.filter(pl.col("worker") == 1)
    assert slow["censored"].all()
    assert (slow["runtime_s"] < slow["injected_delay_s"]).all()  # cut before its delay ended
    assert slow["injected_delay_s"].to_list() == pytest.approx([SLOW_S] * cfg.iterations)
    others = rows.filter(pl.col("worker") != 1)
    assert not others["censored"].any()
    assert (others["runtime_s"] >= FAST_S).all()
    assert rows["cutoff"].to_list() == [3] * rows.height


def test_censored_run_time_is_at_least_the_admitted_ones(slow_worker_run):
    _, _, _, rows, _ = slow_worker_run
    per_iteration = rows.group_by("iteration").agg(
        pl.col("runtime_s").filter(~pl.col("censored")).max().alias("admitted_max"),
        pl.col("runtime_s").filter(pl.col("censored")).min().alias("censored_min"),
    )
    assert per_iteration.height == 16
    late = per_iteration.filter(pl.col("censored_min") < pl.col("admitted_max"))
    assert late.height == 0, late  # censored at the c-th arrival, the cut the policy saw


def test_policy_sees_the_dropped_worker_censored_at_the_cut(slow_worker_run):
    cfg, policy, _, _, _ = slow_worker_run
    assert len(policy.observed) == cfg.iterations
    for runtimes, censored in policy.observed:
        assert censored.tolist() == [False, True, False, False]
        assert runtimes[1] == pytest.approx(runtimes[~censored].max())


def test_engine_state_loads_with_weights_only(slow_worker_run):
    cfg, _, result, _, run_dir = slow_worker_run
    state = torch.load(run_dir / STATE_FILE, weights_only=True)  # never runs code
    assert state["next_iteration"] == cfg.iterations
    assert state["log"]["c"] == result.log["c"]
    assert isinstance(state["overhead"], float)


class ScriptedOnline(RecordingStatic):
    """An online policy: chooses 1, then at every arrival asks for 3 gradients; records what
    each revise() call was shown."""

    online = True

    def __init__(self) -> None:
        super().__init__(1)
        self.revisions: list[tuple[float, np.ndarray, np.ndarray]] = []

    def revise(self, now_s, runtimes, arrived) -> int:
        self.revisions.append((now_s, runtimes.copy(), arrived.copy()))
        return 3


MID_S = 0.15


@pytest.fixture(scope="module")
def online_run(tmp_path_factory):
    """4 workers: 0 and 1 fast, 2 takes 0.15 s, 3 takes 5 s; the policy revises c to 3."""
    tmp = tmp_path_factory.mktemp("online")
    replay = write_replay_trace(tmp / "replay", [[FAST_S, FAST_S, MID_S, SLOW_S]] * 6)
    cfg = engine_config(iterations=6, stragglers=f"replay:{replay}")
    policy = ScriptedOnline()
    result = run_engine(cfg, policy, tmp / "traces", lambda t, row: None)
    return cfg, policy, result, TraceStore(tmp / "traces").read()


def test_an_online_policy_admits_its_revised_c_as_gradients_arrive(online_run):
    cfg, policy, result, rows = online_run
    assert result.log["c"] == [3] * cfg.iterations  # beyond the 1 it chose: it waited for 2
    assert rows.filter(pl.col("worker") == 3)["censored"].all()  # but not for worker 3
    assert not rows.filter(pl.col("worker") != 3)["censored"].any()
    assert rows["cutoff"].to_list() == [3] * rows.height
    for _, censored in policy.observed:
        assert censored.tolist() == [False, False, False, True]


def at_arrivals(revisions: list) -> list:
    """The revise calls made at an arrival (one more worker in than the call before); the
    others were made at the driver's ticks, while nothing arrived."""
    return [r for i, r in enumerate(revisions)
            if i == 0 or r[2].sum() != revisions[i - 1][2].sum()]  # fmt: skip


def test_revise_is_shown_each_arrival_in_order(online_run):
    """At each arrival (1, 2, 3 of each iteration) in order; in between, at ticks, with the
    same workers in and the present moving on."""
    cfg, policy, _, _ = online_run
    arrivals = at_arrivals(policy.revisions)
    assert len(arrivals) == 3 * cfg.iterations
    for (now, _, arrived), (later, _, same) in zip(
        policy.revisions, policy.revisions[1:], strict=False
    ):
        if arrived.sum() == same.sum():
            assert later > now and same.tolist() == arrived.tolist()
    for i in range(0, len(arrivals), 3):
        calls = arrivals[i : i + 3]
        assert [int(a.sum()) for _, _, a in calls] == [1, 2, 3]
        assert calls[1][2].tolist() == [True, True, False, False]  # the two fast ones first
        now, runtimes, arrived = calls[-1]
        assert arrived.tolist() == [True, True, True, False]
        assert now == runtimes[2] >= MID_S  # the present is the latest arrival's run-time
        assert runtimes[2] >= runtimes[:2].max()


@pytest.mark.parametrize(
    ("scaling", "factor"), [("linear", 0.5), ("sqrt", math.sqrt(0.5)), ("none", 1.0)]
)
def test_a_step_on_c_gradients_scales_the_learning_rate_with_c(scaling, factor):
    cfg = engine_config(lr_scaling=scaling, lr=0.1)
    workload = load_workload("mlp")
    params = ServerModel(workload, cfg)
    before = [p.detach().clone() for p in workload.model.parameters()]
    n_params = sum(p.numel() for p in before)
    lr = scaled_lr(cfg, 2, 4)
    assert lr == pytest.approx(0.1 * factor)
    params.step(torch.ones(n_params) * 2, 2, lr)
    after = list(workload.model.parameters())
    # first SGD step with momentum: p -= lr * mean gradient (= 2 / 2)
    assert torch.allclose(before[0] - after[0].detach(), torch.full_like(before[0], lr))


def test_a_step_works_after_the_model_gradients_were_set_to_none():
    cfg = engine_config(lr_scaling="none", lr=0.1, momentum=0.0)
    workload = load_workload("mlp")
    params = ServerModel(workload, cfg)
    workload.model.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in workload.model.parameters()]
    params.step(torch.ones(sum(p.numel() for p in before)), 1, 0.1)
    for b, p in zip(before, workload.model.parameters(), strict=True):
        assert torch.allclose(b - p.detach(), torch.full_like(b, 0.1))


def kill_worker_at(iteration: int, name: str):
    def on_iteration(t: int, row: dict) -> None:
        if t == iteration:
            victim = [p for p in multiprocessing.active_children() if p.name == name]
            victim[0].kill()
            victim[0].join(5)

    return on_iteration


@pytest.fixture(scope="module")
def killed_worker_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("killed")
    cfg = engine_config(iterations=20, stragglers="none")
    policy = RecordingStatic(4)
    result = run_engine(cfg, policy, tmp / "traces", kill_worker_at(8, "bdsgd-worker-1"))
    return cfg, policy, result, TraceStore(tmp / "traces").read()


def test_run_survives_a_killed_worker(killed_worker_run):
    cfg, _, result, _ = killed_worker_run
    assert result.log["iteration"] == list(range(cfg.iterations))
    assert list(result.dead_workers) == [1]
    assert 8 <= result.dead_workers[1] <= 10
    assert not result.interrupted
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("bdsgd-")]


def test_c_never_exceeds_the_live_workers(killed_worker_run):
    _, policy, result, _ = killed_worker_run
    for c, workers in zip(result.log["c"], result.log["workers"], strict=True):
        assert 1 <= c <= workers
    assert result.log["workers"][-1] == 3
    assert result.log["c"][-1] == 3
    assert policy.lives[-1].tolist() == [True, False, True, True]


def test_dead_worker_rows_stop_when_it_died(killed_worker_run):
    cfg, policy, result, rows = killed_worker_run
    dead = rows.filter(pl.col("worker") == 1).sort("iteration")
    died = result.dead_workers[1]
    assert dead["iteration"].max() <= died
    assert dead.filter(pl.col("iteration") > 8)["censored"].all()
    assert dead.filter(pl.col("iteration") > 8).height <= 1
    live = rows.filter(pl.col("worker") != 1)
    assert live.height == 3 * cfg.iterations
    # after the death the policy sees the dead worker censored
    for _, censored in policy.observed[died + 1 :]:
        assert censored[1]


@pytest.fixture(scope="module")
def killed_mid_iteration_run(tmp_path_factory):
    """static:4 of 4 (every gradient awaited); worker 1 is killed during its 3 s delay of
    iteration 4, while the server's receives for that iteration are posted."""
    tmp = tmp_path_factory.mktemp("mid")
    delays = [[FAST_S] * 4 for _ in range(12)]
    delays[4][1] = 3.0
    replay = write_replay_trace(tmp / "replay", delays)
    cfg = engine_config(iterations=12, stragglers=f"replay:{replay}")

    def on_iteration(t: int, row: dict) -> None:
        if t == 3:
            victim = [p for p in multiprocessing.active_children() if p.name == "bdsgd-worker-1"]
            threading.Timer(0.3, victim[0].kill).start()

    result = run_engine(cfg, RecordingStatic(4), tmp / "traces", on_iteration)
    return cfg, result, TraceStore(tmp / "traces").read()


def test_a_worker_killed_mid_iteration_ends_it_with_the_others_gradients(killed_mid_iteration_run):
    cfg, result, rows = killed_mid_iteration_run
    assert result.log["iteration"] == list(range(cfg.iterations))
    assert result.dead_workers == {1: 4}
    assert result.log["chosen_c"][4] == 4 and result.log["c"][4] == 3
    assert result.log["c"][5:] == [3] * (cfg.iterations - 5)  # the new group carries on
    dead = rows.filter(pl.col("worker") == 1).sort("iteration")
    assert dead["iteration"].to_list() == list(range(5))
    assert dead["censored"].to_list() == [False] * 4 + [True]
    assert rows.filter(pl.col("worker") != 1).height == 3 * cfg.iterations
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("bdsgd-")]


class GiveUp(RecordingStatic):
    """Online: at each arrival waits for every worker; asked again while nothing arrives (the
    driver's ticks), stops once 0.3 s have passed."""

    online = True

    def __init__(self) -> None:
        super().__init__(4)

    def revise(self, now_s, runtimes, arrived) -> int:
        return int(arrived.sum()) if now_s >= 0.3 else 4


@pytest.mark.parametrize("engine", ["ps", "collective"])
def test_a_waiting_online_policy_cuts_a_straggler_between_arrivals(tmp_path, engine):
    """Worker 3 takes 5 s every iteration; the policy, asked at each arrival, waits for it, and
    asked again while nothing arrives, stops: every iteration admits the other 3, and worker 3 is
    censored at the tick that cut it (0.3 s or later: ticks 0.05 s after the last arrival,
    doubling), not at its 5 s."""
    replay = write_replay_trace(tmp_path / "replay", [[FAST_S, FAST_S, FAST_S, SLOW_S]] * 3)
    cfg = engine_config(engine=engine, iterations=3, stragglers=f"replay:{replay}")
    result = run_engine(cfg, GiveUp(), tmp_path / "traces", lambda t, r: None)
    assert result.log["c"] == [3, 3, 3]
    rows = TraceStore(tmp_path / "traces").read().filter(pl.col("worker") == 3)
    assert rows["censored"].to_list() == [True] * 3
    assert all(x >= 0.3 for x in rows["runtime_s"].to_list())  # not before it gave up


def test_ctrl_c_after_a_parameter_server_step_records_that_step_and_nothing_after(
    tmp_path, monkeypatch
):
    """Ctrl-C right after the server applied iteration 30's update: 30 is recorded (its update
    is in the parameters the checkpoint holds, so a resumed run must not run it again) and,
    the Ctrl-C being held by then, 31 is never announced; every worker stops on its own."""
    from bdsgd.stages.engine.ps import ParameterServer

    cfg = engine_config(iterations=400, stragglers="synthetic:base_s=0.002")
    sigint_after(ParameterServer, "apply", 30, monkeypatch)
    codes = exit_codes_of_workers(monkeypatch)
    result = run_engine(cfg, RecordingStatic(3), tmp_path / "traces", lambda t, r: None,
                        tmp_path / "run")  # fmt: skip
    assert result.interrupted and result.log["iteration"] == list(range(31))
    rows = TraceStore(tmp_path / "traces").read()
    assert sorted(set(rows["iteration"].to_list())) == list(range(31))
    assert len(codes) == cfg.workers and all(c is not None and c >= 0 for c in codes), codes
