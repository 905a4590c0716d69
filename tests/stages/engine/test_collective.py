"""The collective engine (:class:`Coordinator` + replicas) with real gloo processes and tiny
configs: exactly c contributions, the update equal to the mean of the admitted workers' own
gradients, bit-identical replicas (also after a kill and a hang), resume, online revision."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
import torch
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.base import StopRun
from bdsgd.stages.engine.collective import (
    STAR_CROWDED_MAX_PARAMS,
    STAR_MAX_PARAMS,
    allreduce_algorithm,
)
from bdsgd.stages.engine.config import EngineConfig, scaled_lr
from bdsgd.stages.engine.launch import run_engine
from bdsgd.stages.engine.replica_membership import Membership
from bdsgd.stages.engine.resume import STATE_FILE
from bdsgd.stages.engine.worker_report import SLOT
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.store import TraceStore
from bdsgd.stages.workloads import load_workload

from tests.stages.engine import exit_codes_of_workers, sigint_after, write_replay_trace
from tests.stages.engine.test_engine import (
    FAST_S,
    MID_S,
    SLOW_S,
    RecordingStatic,
    ScriptedOnline,
    at_arrivals,
    engine_config,
    kill_worker_at,
)
from tests.stages.engine.test_failures import own_gradient

pytestmark = pytest.mark.timeout(240)


def collective_config(**overrides) -> EngineConfig:
    return engine_config(**{"engine": "collective", "run_id": "collective-test", **overrides})


def replica_params(run_dir) -> tuple[torch.Tensor, int]:
    state = torch.load(run_dir / STATE_FILE, weights_only=True)
    replica = P.decode_replica_state(state["replica"].numpy().tobytes())
    return replica["params"], replica["steps"]


@pytest.fixture(scope="module")
def slow_worker_run(tmp_path_factory):
    """static:3 of 4 replicas; worker 1's injected delay is 0.5 s, the others' 5 ms."""
    tmp = tmp_path_factory.mktemp("collective-slow")
    replay = write_replay_trace(tmp / "replay", [[FAST_S, SLOW_S, FAST_S, FAST_S]] * 4)
    cfg = collective_config(stragglers=f"replay:{replay}")
    policy = RecordingStatic(3)
    result = run_engine(cfg, policy, tmp / "traces", lambda t, row: None, run_dir=tmp / "run")
    return cfg, policy, result, TraceStore(tmp / "traces").read(), tmp / "run"


def test_every_iteration_admits_exactly_c_and_cuts_the_slow_worker(slow_worker_run):
    cfg, policy, result, rows, _ = slow_worker_run
    assert result.log["iteration"] == list(range(cfg.iterations))
    assert result.log["c"] == [3] * cfg.iterations
    assert rows.height == cfg.iterations * cfg.workers
    slow = rows.filter(pl.col("worker") == 1)
    assert slow["censored"].all() and not rows.filter(pl.col("worker") != 1)["censored"].any()
    assert slow["injected_delay_s"].to_list() == pytest.approx([SLOW_S] * cfg.iterations)
    for runtimes, censored in policy.observed:  # what the policy saw is what the trace holds
        assert censored.tolist() == [False, True, False, False]
        assert runtimes[1] == runtimes[~censored].max()
    cut = rows.filter(pl.col("censored")).sort("iteration")["runtime_s"].to_numpy()
    seen = np.array([r[1] for r, _ in policy.observed])
    assert np.array_equal(cut, np.maximum(seen, 1e-6))


def test_each_row_names_the_device_its_replica_reported(slow_worker_run):
    _, _, result, rows, _ = slow_worker_run
    assert set(rows["device"].to_list()) == {"cpu"} and result.extras["device"] == "cpu"


def test_replicas_stay_bit_identical(slow_worker_run):
    cfg, _, result, _, run_dir = slow_worker_run
    assert len(result.extras["replica_digests"]) == cfg.workers
    assert result.extras["replicas_identical"]
    params, steps = replica_params(run_dir)
    assert steps == cfg.iterations
    assert result.extras["join_lag_ms_p50"] >= 0.0


@pytest.mark.parametrize("allreduce", ["star", "ring"])
def test_the_update_is_the_mean_of_the_admitted_workers_own_gradients(tmp_path, allreduce):
    """One iteration, worker 1 cut off: the replicas' parameters equal the initial ones minus
    lr(3 of 4) times the mean of workers 0, 2 and 3's gradients, computed here independently,
    whichever way the replicas sum."""
    replay = write_replay_trace(tmp_path / "replay", [[FAST_S, SLOW_S, FAST_S, FAST_S]])
    cfg = collective_config(iterations=1, stragglers=f"replay:{replay}", allreduce=allreduce)
    run_engine(cfg, RecordingStatic(3), tmp_path / "traces", lambda t, r: None, tmp_path / "run")
    params, _ = replica_params(tmp_path / "run")
    grads = [own_gradient(cfg, w) for w in (0, 2, 3)]
    workload = load_workload(cfg.workload, seed=cfg.seed)
    init = torch.cat([p.detach().reshape(-1) for p in workload.model.parameters()])
    expected = init - scaled_lr(cfg, 3, 4) * torch.stack(grads).mean(0)
    assert torch.allclose(params, expected, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(params, init - scaled_lr(cfg, 4, 4) * own_gradient(cfg, 1))


def test_the_replicas_step_torch_sgd_with_momentum(tmp_path):
    """Three iterations of 2 replicas, nobody cut: their parameters are what torch's SGD with
    momentum makes of the mean of the two workers' own gradients, computed here from their data
    streams."""
    cfg = collective_config(workers=2, hosts=("h0", "h1"), iterations=3, stragglers="none",
                            lr_scaling="none", momentum=0.9)  # fmt: skip
    run_engine(cfg, RecordingStatic(2), tmp_path / "traces", lambda t, r: None, tmp_path / "run")
    params, steps = replica_params(tmp_path / "run")
    workload = load_workload(cfg.workload, seed=cfg.seed)
    model = workload.model
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    gens = [torch.Generator().manual_seed(cfg.seed * 1_000_003 + w + 1) for w in range(2)]
    for _ in range(cfg.iterations):
        grads = []
        for gen in gens:
            model.zero_grad()
            x, y = workload.batch(gen, cfg.batch_size)
            workload.loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *mine in zip(model.parameters(), *grads, strict=True):
            p.grad = torch.stack(mine).mean(0)
        opt.step()
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert steps == cfg.iterations
    assert torch.allclose(params, expected, atol=1e-6, rtol=1e-5)


def held_out_loss(cfg: EngineConfig, params: torch.Tensor) -> float:
    """The workload's held-out loss at flat ``params``, computed here."""
    workload = load_workload(cfg.workload, seed=cfg.seed)
    torch.nn.utils.vector_to_parameters(params, workload.model.parameters())
    x, y = workload.eval_batch
    with torch.no_grad():
        return float(workload.loss(workload.model(x), y))


def test_the_held_out_loss_of_an_iteration_is_of_the_parameters_after_it(tmp_path):
    """Every replica evaluates its slice after iteration t's step, summed by t + 1's
    all-reduce: the loss logged for the last iteration (evaluated whole at the end) is that of
    the final parameters, and the one before it is not; every due iteration has its loss."""
    cfg = collective_config(iterations=6, eval_every=1, workers=2, hosts=("h0", "h1"))
    result = run_engine(cfg, RecordingStatic(2), tmp_path / "traces", lambda t, r: None,
                        tmp_path / "run")  # fmt: skip
    final = held_out_loss(cfg, replica_params(tmp_path / "run")[0])
    losses = result.log["eval_loss"]
    assert all(loss is not None for loss in losses)
    assert losses[-1] == pytest.approx(final, rel=1e-5)
    assert result.final_eval_loss == pytest.approx(final, rel=1e-5)
    assert losses[-2] != pytest.approx(final, rel=1e-5)


def test_every_held_out_loss_is_of_the_parameters_after_its_iteration(tmp_path):
    """Three replicas: the loss logged for every iteration equals the held-out loss at the
    parameters after it, read from the checkpoint written after each iteration (the callback of
    t sees the one after t - 1), though t + 1's all-reduce sums the slices of t's."""
    cfg = collective_config(iterations=6, eval_every=1, workers=3, hosts=("h0", "h1", "h2"),
                            record_batch=1, record_s=0.0)  # fmt: skip
    after: dict[int, torch.Tensor] = {}

    def on_iteration(t: int, row: dict) -> None:
        if t > 0:
            after[t - 1] = replica_params(tmp_path / "run")[0]

    result = run_engine(cfg, RecordingStatic(3), tmp_path / "traces", on_iteration,
                        tmp_path / "run")  # fmt: skip
    losses = result.log["eval_loss"]
    assert sorted(after) == [0, 1, 2, 3, 4]
    for t, params in after.items():
        assert losses[t] == pytest.approx(held_out_loss(cfg, params), rel=1e-5)
    assert len({round(loss, 6) for loss in losses}) == len(losses)  # the losses move


def test_an_online_policy_admits_its_revised_c(tmp_path):
    replay = write_replay_trace(tmp_path / "replay", [[FAST_S, FAST_S, MID_S, SLOW_S]] * 6)
    cfg = collective_config(iterations=6, stragglers=f"replay:{replay}")
    policy = ScriptedOnline()
    result = run_engine(cfg, policy, tmp_path / "traces", lambda t, row: None)
    assert result.log["c"] == [3] * cfg.iterations
    assert len(at_arrivals(policy.revisions)) == 3 * cfg.iterations
    rows = TraceStore(tmp_path / "traces").read()
    assert rows.filter(pl.col("worker") == 3)["censored"].all()
    assert rows["cutoff"].to_list() == [3] * rows.height
    assert result.extras["replicas_identical"]


@pytest.mark.parametrize(("allreduce", "victim"), [("star", 1), ("ring", 1), ("star", 0)])
def test_a_killed_replica_is_excluded_and_the_survivors_stay_identical(tmp_path, allreduce, victim):
    """Worker 0 is the lowest replica: the star's root, and the one whose steps the coordinator
    reads (a batch it had not published dies with it)."""
    cfg = collective_config(iterations=20, stragglers="synthetic:base_s=0.005",
                            allreduce=allreduce)  # fmt: skip
    policy = RecordingStatic(4)
    kill = kill_worker_at(8, f"bdsgd-worker-{victim}")
    result = run_engine(cfg, policy, tmp_path / "traces", kill)
    assert result.log["iteration"] == list(range(cfg.iterations))
    assert list(result.dead_workers) == [victim]
    assert result.log["workers"][-1] == 3 and result.log["c"][-1] == 3
    survivors = [str(w) for w in range(4) if w != victim]
    assert sorted(result.extras["replica_digests"]) == survivors
    assert result.extras["replicas_identical"]
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("bdsgd-")]
    rows = TraceStore(tmp_path / "traces").read()
    assert rows.filter(pl.col("worker") == victim)["iteration"].max() <= result.dead_workers[victim]


def test_a_replica_killed_while_the_coordinator_lags_behind_is_regrouped(tmp_path):
    """The coordinator lags (half a second in its callback) while the replicas finish the
    block announced ahead and wait for the next; a worker killed then is found between
    iterations, and the survivors learn of the regrouping from the next announcement. (With the
    steps keyed by generation, the coordinator waited for steps of the new one that no replica
    would publish, and declared them all hung.)"""
    cfg = collective_config(iterations=30, stragglers="synthetic:base_s=0.02", allreduce="ring",
                            timeout_s=10.0)  # fmt: skip

    def on_iteration(t: int, row: dict) -> None:
        if t == 10:
            time.sleep(0.5)  # (the replicas run ahead to the end of their block meanwhile)
            victim = [p for p in multiprocessing.active_children() if p.name == "bdsgd-worker-2"]
            victim[0].kill()
            victim[0].join(5)

    result = run_engine(cfg, RecordingStatic(4), tmp_path / "traces", on_iteration)
    assert result.log["iteration"] == list(range(cfg.iterations))
    assert list(result.dead_workers) == [2]
    assert result.log["workers"][-1] == 3 and result.log["c"][-1] == 3
    assert sorted(result.extras["replica_digests"]) == ["0", "1", "3"]
    assert result.extras["replicas_identical"]


@pytest.mark.parametrize("victim", [0, 2])
def test_after_a_death_the_updates_logged_are_the_updates_the_replicas_applied(tmp_path, victim):
    """The replicas run a fixed c's block ahead of the coordinator, and the lowest one publishes
    their steps in batches: killed mid-block, it takes an unpublished batch with it, and the
    survivors had applied those steps. Every update the replicas applied is in the log, once:
    the final state's step count equals the iterations logged with an update, and the
    survivors stay identical."""
    cfg = collective_config(iterations=40, stragglers="synthetic:base_s=0.001", timeout_s=10.0,
                            record_batch=1000)  # fmt: skip
    result = run_engine(cfg, RecordingStatic(4), tmp_path / "traces",
                        kill_worker_at(12, f"bdsgd-worker-{victim}"), tmp_path / "run")  # fmt: skip
    assert result.log["iteration"] == list(range(cfg.iterations))
    assert list(result.dead_workers) == [victim]
    _, steps = replica_params(tmp_path / "run")
    assert steps == sum(c > 0 for c in result.log["c"])
    assert result.log["workers"][-1] == 3 and result.log["c"][-1] == 3
    assert result.extras["replicas_identical"]


@pytest.mark.parametrize(("allreduce", "hung"), [("ring", 2), ("star", 2), ("star", 0)])
def test_a_hung_replica_is_found_by_the_failed_all_reduce(tmp_path, allreduce, hung):
    """A worker stops (SIGSTOP) while alive -- for the star also its root, the lowest replica:
    the others' all-reduce times out, they report it, the coordinator declares the silent member
    dead and the run goes on without it (a new lowest replica hands its state to the rest). The
    timeout leaves the survivors time to regroup on a loaded machine: at 10 s, at a load of 7 on
    2 cores, they sent nothing in time after the regrouping and were declared dead too."""
    cfg = collective_config(iterations=14, timeout_s=30.0, stragglers="synthetic:base_s=0.005",
                            allreduce=allreduce)  # fmt: skip

    def on_iteration(t: int, row: dict) -> None:
        if t == 4:
            name = f"bdsgd-worker-{hung}"
            victim = [p for p in multiprocessing.active_children() if p.name == name]
            os.kill(victim[0].pid, signal.SIGSTOP)

    result = run_engine(cfg, RecordingStatic(3), tmp_path / "traces", on_iteration)
    assert result.log["iteration"] == list(range(cfg.iterations))
    assert list(result.dead_workers) == [hung]
    assert result.log["workers"][-1] == 3
    assert sorted(result.extras["replica_digests"]) == [str(w) for w in range(4) if w != hung]
    assert result.extras["replicas_identical"]
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("bdsgd-")]


def test_resume_continues_from_the_replica_state(tmp_path):
    cfg = collective_config(iterations=10, stragglers="synthetic:base_s=0.005")
    run_dir = tmp_path / "run"
    run_engine(cfg, RecordingStatic(3), tmp_path / "traces", lambda t, r: None, run_dir)
    first, steps = replica_params(run_dir)
    assert steps == 10
    state = torch.load(run_dir / STATE_FILE, weights_only=True)
    longer = collective_config(iterations=15, stragglers="synthetic:base_s=0.005")
    result = run_engine(
        longer, RecordingStatic(3), tmp_path / "traces", lambda t, r: None, run_dir, state
    )
    assert result.log["iteration"] == list(range(15))
    after, steps = replica_params(run_dir)
    assert steps == 15 and not torch.equal(first, after)
    assert result.extras["replicas_identical"]


@pytest.mark.parametrize("engine", ["collective", "ps"])
def test_both_engines_estimate_the_noise_scale_and_push_it_to_the_policy(tmp_path, engine):
    """static:3 of 4 (three gradients an iteration): the engine logs a noise scale and gain per
    iteration once it has gradients to estimate from, and the policy is told before choosing.
    Early on the gradient mostly dominates its noise, so most of the first iterations have a
    finite estimate; the noise can drown the signal in any one iteration (the estimate is inf,
    logged as None: seen at iteration 5 of a ps run), so no single iteration is required to
    have one."""
    cfg = collective_config(engine=engine, iterations=12, stragglers="synthetic:base_s=0.005")
    policy = RecordingStatic(3)
    result = run_engine(cfg, policy, tmp_path / "traces", lambda t, r: None)
    logged = result.log["noise_scale"]
    assert sum(v is not None for v in logged[2:6]) >= 3, logged
    scales = [v for v in logged if v is not None]
    assert len(scales) >= cfg.iterations // 2 and all(v > 0 for v in scales)
    assert all(1.0 <= g <= 3.0 for g in result.log["gain"] if g is not None)
    assert policy.noise_scale is not None and policy.batch_size == cfg.batch_size


@pytest.mark.parametrize("live", [0, 1])
def test_an_announcement_is_one_integer(live):
    cases = [(0, 0, 0), (0, 1, 8), (3, 1000, 255), (1 << 20, (1 << 23) - 1, 7)]
    for generation, limit, span in cases:
        code = P.encode_announcement(generation, limit, live, span)
        assert code >= 1  # 0 means "not announced yet"
        assert P.decode_announcement(code) == (generation, limit, live, span)


def test_a_batch_of_steps_is_found_from_any_of_its_keys():
    """The first key holds the batch, each later one points to it: read from any of them, the
    batch holds every step as published, and a batch of k moves k steps once."""
    steps = [
        (t, P.encode_step((2, 1.5, 0.25, 64), bytes([t]) * 8, (t - 1, 2.5))) for t in (7, 8, 9)
    ]
    values = P.batch_values(steps)
    assert P.batch_pointer(values[0]) is None
    assert [P.batch_pointer(v) for v in values[1:]] == [7, 7]
    assert P.decode_batch(values[0]) == dict(steps)
    assert len(values[0]) < sum(len(step) for _, step in steps) + 64
    single = P.batch_values(steps[:1])
    assert len(single) == 1 and P.decode_batch(single[0]) == dict(steps[:1])


def test_a_step_carries_the_held_out_loss_the_all_reduce_summed():
    slots = np.zeros(2 * SLOT, dtype="f4").tobytes()
    step = P.decode_step(P.encode_step((3, 1.0, 0.5, 96), slots, (41, 2.25), 0.0375))
    assert step.stats == (3, 1.0, 0.5, 96) and step.evaluated == (41, 2.25)
    assert step.lr == 0.0375  # the learning rate the replicas applied, as they computed it
    assert step.reports == []  # (empty slots: nobody's report)
    bare = P.decode_step(P.encode_step((), slots))
    assert bare.stats is None and bare.evaluated is None and bare.lr is None


def test_an_adaptive_fixed_c_reads_the_arrivals_live_with_the_same_outcome(tmp_path):
    """The same static:3 marked adaptive (as ewma or ecdf are): the coordinator reads the
    tickets as they come, not the reports the all-reduce carries; same c, same censoring."""
    replay = write_replay_trace(tmp_path / "replay", [[FAST_S, SLOW_S, FAST_S, FAST_S]] * 4)
    cfg = collective_config(stragglers=f"replay:{replay}", iterations=8)
    policy = RecordingStatic(3)
    policy.adaptive = True
    result = run_engine(cfg, policy, tmp_path / "traces", lambda t, row: None)
    assert result.log["c"] == [3] * cfg.iterations
    rows = TraceStore(tmp_path / "traces").read()
    assert rows.height == cfg.iterations * cfg.workers
    assert rows.filter(pl.col("censored"))["worker"].to_list() == [1] * cfg.iterations
    for _, censored in policy.observed:
        assert censored.tolist() == [False, True, False, False]
    assert result.extras["replicas_identical"]


def interrupt_mid_announcement(monkeypatch, engine_class, after: int) -> list[int]:
    """Ctrl-C (a real SIGINT to this process) right after the engine wrote the keys of
    iterations past ``after`` (a block of them, or the next one), before it counted them as
    announced; returns [the block's first iteration, its last]."""
    original, hit = engine_class.announce_block, []

    def announce_block(self, first: int, last: int, limit: int) -> None:
        original(self, first, last, limit)
        if not hit and first > after:
            hit.extend([first, last])
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs before this returns

    monkeypatch.setattr(engine_class, "announce_block", announce_block)
    return hit


@pytest.mark.parametrize("engine", ["collective", "ps"])
def test_ctrl_c_mid_announcement_still_stops_every_worker(tmp_path, monkeypatch, engine):
    """An announcement (its keys and the engine's count of what it announced) lands whole
    under Ctrl-C: the stop goes after the last iteration any worker was told of, so every
    worker stops on its own (none is killed at the end), and every replica reports, instead of
    waiting for an iteration nobody runs (seen in CI: a 30 s hang after Ctrl-C)."""
    from bdsgd.stages.engine.launch import VARIANTS

    cfg = collective_config(engine=engine, iterations=400, stragglers="synthetic:base_s=0.002")
    hit = interrupt_mid_announcement(monkeypatch, VARIANTS[engine][0], after=12)
    codes = exit_codes_of_workers(monkeypatch)
    result = run_engine(cfg, RecordingStatic(3), tmp_path / "traces", lambda t, r: None,
                        tmp_path / "run")  # fmt: skip
    assert hit and result.interrupted
    assert result.dead_workers == {}
    assert result.log["iteration"] == list(range(len(result.log["iteration"])))
    assert len(codes) == cfg.workers and all(c is not None and c >= 0 for c in codes), codes
    if engine == "collective":  # every replica reached the stop and published what it holds
        assert hit[1] > hit[0]  # (a block of iterations was announced at once)
        assert sorted(result.extras["replica_digests"]) == ["0", "1", "2", "3"]
        assert result.extras["replicas_identical"] and result.final_eval_loss is not None
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("bdsgd-")]


@pytest.mark.parametrize("engine", ["collective", "ps"])
def test_a_stop_rule_records_what_was_announced_and_every_worker_stops_on_its_own(
    tmp_path, monkeypatch, engine
):
    """A stop rule (a target, a wall budget) ends the run after iteration 5, when iteration 6
    is announced already (a block of them for the collective's fixed c). Every worker is
    admitted (static:4 of 4 cuts nobody), so each runs 6 and hands its gradient on: the engine
    runs and records what it announced, instead of closing its group under a parameter-server
    worker that then waits out --timeout sending its gradient, and is killed (seen in CI)."""
    cfg = collective_config(engine=engine, iterations=400, stragglers="synthetic:base_s=0.002")
    codes = exit_codes_of_workers(monkeypatch)

    def stop_after_5(t: int, row: dict) -> None:
        if t == 5:
            raise StopRun

    result = run_engine(cfg, RecordingStatic(cfg.workers), tmp_path / "traces", stop_after_5,
                        tmp_path / "run")  # fmt: skip
    logged = result.log["iteration"]
    assert logged == list(range(len(logged))) and len(logged) < cfg.iterations
    assert len(logged) == 7 if engine == "ps" else len(logged) >= 7
    assert TraceStore(tmp_path / "traces").read().height == len(logged) * cfg.workers
    assert len(codes) == cfg.workers and all(c is not None and c >= 0 for c in codes), codes
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("bdsgd-")]


@pytest.mark.parametrize("policy", ["static", "online"])
@pytest.mark.parametrize("where", ["between iterations", "mid-iteration"])
def test_ctrl_c_records_every_iteration_the_replicas_ran(tmp_path, monkeypatch, policy, where):
    """The replicas run every iteration announced to them (up to 64 ahead for a fixed c, the
    next one online) before they see the stop: after Ctrl-C, between iterations or while one is
    admitted, the coordinator records those too, so the log, the traces and the checkpoint's
    replica state agree (a resumed run continues right after the last logged iteration). A
    Ctrl-C held while an iteration runs announces nothing more."""
    from bdsgd.stages.engine.collective import Coordinator

    cfg = collective_config(iterations=400, stragglers="synthetic:base_s=0.002")
    on_iteration = lambda t, row: None  # noqa: E731
    if where == "between iterations":

        def on_iteration(t, row):
            if t == 30:
                os.kill(os.getpid(), signal.SIGINT)
    else:
        sigint_after(Coordinator, "admit", 30, monkeypatch)
    chosen = RecordingStatic(3) if policy == "static" else ScriptedOnline()
    result = run_engine(cfg, chosen, tmp_path / "traces", on_iteration, tmp_path / "run")
    logged = result.log["iteration"]
    assert result.interrupted and logged == list(range(len(logged)))
    if where == "mid-iteration" and policy == "online":
        assert len(logged) == 31  # Ctrl-C held while 30 ran: nothing was announced after it
    else:  # and what was announced before the Ctrl-C (how far ahead depends on the machine's
        # speed: a block of fixed-c iterations is announced at most 50 ms ahead)
        assert len(logged) >= 31
    _, steps = replica_params(tmp_path / "run")
    assert steps == len(logged)
    rows = TraceStore(tmp_path / "traces").read()
    assert sorted(set(rows["iteration"].to_list())) == logged
    assert result.extras["replicas_identical"]


def test_ctrl_c_on_slow_iterations_stops_after_the_one_under_way(tmp_path, monkeypatch):
    """Iterations of 0.3 s (a worker's injected delay, every gradient awaited) are announced
    one at a time (8 of them would keep a stop waiting 2.4 s): Ctrl-C while iteration 3 is
    admitted ends the run after it, with log, traces and replica state agreeing."""
    from bdsgd.stages.engine.collective import Coordinator

    replay = write_replay_trace(tmp_path / "replay", [[0.3, FAST_S, FAST_S, FAST_S]] * 12)
    cfg = collective_config(iterations=12, stragglers=f"replay:{replay}")
    sigint_after(Coordinator, "admit", 3, monkeypatch)
    result = run_engine(cfg, RecordingStatic(4), tmp_path / "traces", lambda t, r: None,
                        tmp_path / "run")  # fmt: skip
    assert result.interrupted and result.log["iteration"] == [0, 1, 2, 3]
    assert replica_params(tmp_path / "run")[1] == 4
    rows = TraceStore(tmp_path / "traces").read()
    assert sorted(set(rows["iteration"].to_list())) == [0, 1, 2, 3]


def test_auto_sums_by_star_on_one_machine_for_a_small_model_on_the_cpu():
    cfg = collective_config(device="cpu")  # 4 workers
    assert allreduce_algorithm(cfg, torchrun=False, params=77_000, cores=16) == "star"
    assert allreduce_algorithm(cfg, torchrun=True, params=77_000, cores=16) == "ring"
    assert allreduce_algorithm(cfg, torchrun=False, params=STAR_MAX_PARAMS, cores=16) == "star"
    assert allreduce_algorithm(cfg, torchrun=False, params=STAR_MAX_PARAMS + 1, cores=16) == "ring"
    ring = collective_config(device="cpu", allreduce="ring")
    assert allreduce_algorithm(ring, torchrun=False, params=77_000, cores=16) == "ring"


def test_auto_sums_a_larger_model_by_star_only_with_more_workers_than_cores():
    cfg = collective_config(device="cpu")  # 4 workers
    mid = (STAR_MAX_PARAMS + STAR_CROWDED_MAX_PARAMS) // 2
    assert allreduce_algorithm(cfg, torchrun=False, params=mid, cores=2) == "star"
    assert allreduce_algorithm(cfg, torchrun=False, params=mid, cores=4) == "ring"
    big = STAR_CROWDED_MAX_PARAMS + 1
    assert allreduce_algorithm(cfg, torchrun=False, params=big, cores=2) == "ring"


def test_under_torchrun_auto_sums_by_ring_without_resolving_this_hosts_device():
    """The coordinator's host may have no GPU while the workers' machines do."""
    cfg = collective_config(device="cuda")
    assert allreduce_algorithm(cfg, torchrun=True, params=77_000, cores=16) == "ring"


def test_a_star_on_cuda_tensors_is_refused():
    with pytest.raises(ConfigError, match="--allreduce star"):
        collective_config(device="cuda", allreduce="star")


def _sync_state_member(rank: int, port: int, steps: list[int], q) -> None:
    """One member of a new generation: a gloo group of len(steps) over the test's store, and
    the replica's own sync_state on parameters and momentum that name the member."""
    store = P.open_store("127.0.0.1", port, False, 30.0)
    members = [10 + r for r in range(len(steps))]
    member = SimpleNamespace(
        members=members, spec=SimpleNamespace(worker_id=10 + rank), device=torch.device("cpu"),
        group=P.build_group(store, 0, members, 10 + rank, "127.0.0.1", 30.0),
    )  # fmt: skip
    flat, momentum = torch.full((5,), float(rank)), torch.full((5,), -float(rank))
    taken = Membership.sync_state(member, flat, momentum, steps[rank])
    q.put((rank, taken, flat.tolist(), momentum.tolist()))


@pytest.mark.parametrize("steps", [[5, 6, 6], [7, 6, 7], [4, 4, 3]])
def test_a_new_generation_takes_the_state_of_the_member_that_applied_the_most_steps(steps):
    """A member that died inside an all-reduce can leave its result with some survivors and not
    others; those that applied it publish its step, so the new generation keeps their state
    (the lowest such rank's), whichever rank it is, not the lowest member's."""
    store = P.open_store("127.0.0.1", 0, True, 30.0)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_sync_state_member, args=(r, store.port, steps, q), daemon=True)
             for r in range(len(steps))]  # fmt: skip
    for p in procs:
        p.start()
    try:
        got = dict((r, rest) for r, *rest in (q.get(timeout=60) for _ in procs))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    source = steps.index(max(steps))
    assert sorted(got) == list(range(len(steps)))
    for taken_steps, flat, momentum in got.values():
        assert taken_steps == max(steps)
        assert flat == [float(source)] * 5
        assert momentum == [-float(source)] * 5


@pytest.mark.parametrize("live_arrivals", [False, True], ids=["replicas-cut", "read-live"])
def test_the_logged_learning_rate_is_the_one_the_replicas_applied_under_salvage(
    tmp_path, live_arrivals
):
    """static:2 of 3 with --salvage and no injected delay: the worker cut off always finished
    its first micro-batch (the cut is checked between micro-batches), so every step applies
    more samples than c batches, and the replicas scale the learning rate to them. The log
    holds that value (whole micro-batches' worth of it, above c's) whether the coordinator
    reads the step before the row (a fixed c decided by the replicas) or after (arrivals read
    live), and the last one equals the learning rate the lowest replica's optimizer holds at
    the end."""
    cfg = collective_config(workers=3, hosts=("h0", "h1", "h2"), iterations=12, batch_size=8,
                            micro_batches=4, salvage=True, record_batch=4)  # fmt: skip
    policy = RecordingStatic(2)
    policy.adaptive = live_arrivals  # (adaptive: the coordinator reads the tickets live)
    result = run_engine(cfg, policy, tmp_path / "traces", lambda t, row: None, tmp_path / "run")
    assert result.log["c"] == [2] * cfg.iterations and not result.dead_workers
    micro_batch_lr = cfg.lr / (cfg.workers * cfg.micro_batches)  # linear: lr * (samples/b) / N
    for t, lr in enumerate(result.log["lr"]):
        micro_batches = lr / micro_batch_lr
        assert micro_batches == pytest.approx(round(micro_batches)), t
        assert 2 * cfg.micro_batches < round(micro_batches) <= 3 * cfg.micro_batches, t
    state = torch.load(tmp_path / "run" / STATE_FILE, weights_only=True)
    replica = P.decode_replica_state(state["replica"].numpy().tobytes())
    assert replica["steps"] == cfg.iterations
    assert replica["lr"] == result.log["lr"][-1]
