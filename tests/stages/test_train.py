"""The train stage's pure parts: time_to_loss, config checks, policies it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from bdsgd.stages.engine.base import StopRun
from bdsgd.stages.engine.launch import check_asynchronous
from bdsgd.stages.errors import CheckpointError, ConfigError
from bdsgd.stages.smoothing import time_to_loss
from bdsgd.stages.store import TraceStore
from bdsgd.stages.train import (
    StopRule,
    TrainConfig,
    build_policy,
    check_resumable,
    load_state,
    replay_async_history,
    resume_config,
)

from tests.stages.test_train_run_dir import prepare_run_dir


def test_time_to_loss_smooths_before_comparing():
    log = {"loss": [2.0, 0.0, 0.0, 0.0], "wall_s": [1.0, 2.0, 3.0, 4.0]}
    # EWMA with alpha 0.5: 2.0, 1.0, 0.5, 0.25 -- a single low loss is not enough
    assert time_to_loss(log, 0.6, alpha=0.5) == 3.0
    assert time_to_loss(log, 2.0, alpha=0.5) == 1.0


def test_time_to_loss_skips_missing_losses_and_is_none_when_never_reached():
    log = {"loss": [None, 3.0, 2.5], "wall_s": [1.0, 2.0, 3.0]}
    assert time_to_loss(log, 1.0) is None
    assert time_to_loss(log, 3.0) == 2.0
    assert time_to_loss(log, None) is None
    assert time_to_loss({}, 1.0) is None


def stop_at(rule: StopRule, rows: list[tuple[float | None, float]]) -> int | None:
    """The index of the (loss, wall_s) row after which ``rule`` ends the run (None: never)."""
    for i, (loss, wall) in enumerate(rows):
        try:
            rule({"loss": loss, "wall_s": wall})
        except StopRun:
            return i
    return None


def test_stop_rule_ends_at_the_smoothed_target_as_time_to_loss_counts_it(tmp_path):
    rows = [(3.0, 1.0), (None, 2.0), (1.0, 3.0), (1.0, 4.0), (1.0, 5.0), (1.0, 6.0)]
    cfg = config(tmp_path, target_loss=2.5, stop_at_target=True)
    rule = StopRule(cfg)
    index = stop_at(rule, rows)
    log = {"loss": [r[0] for r in rows], "wall_s": [r[1] for r in rows]}
    assert rows[index][1] == time_to_loss(log, 2.5) and rule.reason == "target"
    assert stop_at(StopRule(config(tmp_path, target_loss=2.5)), rows) is None  # no flag: no stop


def test_stop_rule_ends_once_the_wall_budget_is_spent(tmp_path):
    rule = StopRule(config(tmp_path, max_wall_s=3.5))
    assert stop_at(rule, [(3.0, 1.0), (2.0, 2.0), (1.0, 3.0), (1.0, 4.0), (1.0, 5.0)]) == 3
    assert rule.reason == "wall budget"


def test_stop_rule_of_a_resumed_run_continues_its_smoothed_loss(tmp_path):
    cfg = config(tmp_path, target_loss=1.5, stop_at_target=True)
    fresh, resumed = StopRule(cfg), StopRule(cfg, {"loss": [3.0, 3.0, 3.0]})
    assert stop_at(fresh, [(1.0, 1.0)]) == 0  # its first loss is below the target
    assert stop_at(resumed, [(1.0, 1.0)] * 3) is None  # 3.0 smoothed with 1.0: not yet
    assert resumed.reason == "iterations"


def config(tmp_path, **overrides) -> TrainConfig:
    values = dict(
        workers=4, iterations=10, policy="static:3", traces=tmp_path / "t", out=tmp_path / "o"
    )
    return TrainConfig(**{**values, **overrides})


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (dict(workers=0), "--workers and --iterations must be >= 1"),
        (dict(lr_scaling="cubic"), "--lr-scaling must be one of .*got 'cubic'"),
        (dict(min_workers=5), r"--min-workers must be in 1\.\.4"),
        (dict(batch_size=2, micro_batches=4), "smaller than --micro-batches"),
        (dict(lr=0.0), "--lr must be a finite number > 0, got 0.0"),
        (dict(start_timeout_s=0.0), "--start-timeout must be a finite number > 0, got 0.0"),
        (dict(explore=1.0), r"--explore must be in \[0, 1\), got 1.0"),
        (dict(stop_at_target=True), "--stop-at-target needs --target-loss"),
        (dict(max_wall_s=0.0), "--max-wall-s must be a finite number > 0, got 0.0"),
        (dict(overhead_s=-1.0), "--overhead-s must be a finite number >= 0, got -1.0"),
        (dict(overhead_s=float("nan")), "--overhead-s must be a finite number >= 0, got nan"),
        (dict(target_loss=float("nan")), "--target-loss must be a finite number, got nan"),
    ],
)
def test_train_config_rejects_bad_values(tmp_path, bad, needle):
    with pytest.raises(ConfigError, match=needle):
        config(tmp_path, **bad)


def test_train_config_accepts_adascale_and_goodput_policies(tmp_path):
    cfg = config(tmp_path, lr_scaling="adascale", policy="ewma:goodput")
    assert build_policy(cfg, ("h",) * 4).name == "ewma:goodput"


@pytest.mark.parametrize(
    ("policy", "needle"),
    [("k-batch-sync:2", "does not run 'k-batch-sync:2' yet"), ("oracle", "only in simulation")],
)
def test_train_refuses_policies_it_cannot_run(tmp_path, policy, needle):
    cfg = config(tmp_path, policy=policy)
    with pytest.raises(ConfigError, match=needle):
        build_policy(cfg, ("h",) * 4)


@pytest.mark.parametrize("policy", ["async", "k-async:2", "adasync"])
def test_train_runs_asynchronous_policies(tmp_path, policy):
    assert build_policy(config(tmp_path, policy=policy), ("h",) * 4).mode == "k-async"


def test_explore_wraps_learning_cutoff_policies(tmp_path):
    from bdsgd.stages.policies.explore import Exploring

    policy = build_policy(config(tmp_path, policy="ewma", explore=0.1), ("h",) * 4)
    assert isinstance(policy, Exploring) and policy.fraction == 0.1
    assert not isinstance(build_policy(config(tmp_path, explore=0.1), ("h",) * 4), Exploring)


@pytest.mark.parametrize(("workers", "updates"), [(4, 100), (8, 300), (3, 40)])
def test_adasync_reaches_k_equal_n_in_the_last_stage_of_the_updates(tmp_path, workers, updates):
    cfg = config(tmp_path, policy="adasync", workers=workers, iterations=updates)
    policy = build_policy(cfg, ("h",) * workers)
    ks = [policy.choose(np.ones(workers, dtype=bool)) for _ in range(updates)]
    assert ks[0] == 1 and ks[-1] == workers
    assert ks.index(workers) > updates // 2  # the stages are spread over the run


def resumable(engine: str, workers: int = 4, live: int = 4, next_iteration: int = 5) -> dict:
    """The parts of an engine checkpoint :func:`check_resumable` reads."""
    alive = [True] * live + [False] * (workers - live)
    return {"engine": engine, "live": alive, "next_iteration": next_iteration}


def test_resume_refuses_a_checkpoint_of_another_engine(tmp_path):
    cfg = config(tmp_path, policy="async")
    asynchronous = build_policy(cfg, ("h",) * 4)
    engine = cfg.engine_settings("r")
    with pytest.raises(CheckpointError, match="written by the ps engine"):
        check_resumable(resumable("ps"), cfg, engine, asynchronous)
    check_resumable(resumable("async"), cfg, engine, asynchronous)


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        (resumable("async", workers=3, live=3), CheckpointError, "holds 3 workers"),
        (resumable("async", live=1), CheckpointError, "fewer than the run's --min-workers 2"),
        (resumable("async", next_iteration=10), ConfigError, "already run 10 iterations"),
    ],
)
def test_resume_refuses_a_state_the_run_cannot_continue(tmp_path, state, error, match):
    """Another run's state (other N), too few workers left, or nothing left to run (a finished
    run is not run again, its summary stays)."""
    cfg = config(tmp_path, min_workers=2, policy="async")  # 4 workers, 10 updates
    policy = build_policy(cfg, ("h",) * 4)
    with pytest.raises(error, match=match):
        check_resumable(state, cfg, cfg.engine_settings("r"), policy)
    check_resumable(resumable("async", live=2, next_iteration=9), cfg,
                    cfg.engine_settings("r"), policy)  # fmt: skip


def test_resume_refuses_a_checkpoint_copied_from_another_run(tmp_path):
    """The run directory's config names the run it was started for; a checkpoint of another
    run (same engine, same N) is refused. A directory written before config.json named it
    resumes as before."""
    cfg = config(tmp_path, run_id="train-mine", policy="async")
    policy = build_policy(cfg, ("h",) * 4)
    prepare_run_dir(cfg)
    cfg = resume_config(cfg.out)
    assert cfg.run_id == "train-mine"
    with pytest.raises(CheckpointError, match="belongs to run train-other, not to train-mine"):
        check_resumable({**resumable("async"), "run_id": "train-other"}, cfg,
                        cfg.engine_settings("train-other"), policy)  # fmt: skip
    check_resumable({**resumable("async"), "run_id": "train-mine"}, cfg,
                    cfg.engine_settings("train-mine"), policy)  # fmt: skip
    older = {k: v for k, v in cfg.to_json().items() if k != "run_id"}  # written before it was
    (cfg.out / "config.json").write_text(json.dumps(older))
    cfg = resume_config(cfg.out)
    check_resumable({**resumable("async"), "run_id": "train-other"}, cfg,
                    cfg.engine_settings("train-other"), policy)  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "log", "match"),
    [
        (dict(target_loss=1.5, stop_at_target=True), {"loss": [1.0] * 5, "wall_s": [1.0] * 5},
         "smoothed loss 1 reached --target-loss 1.5"),
        (dict(max_wall_s=3.0), {"loss": [2.0] * 4, "wall_s": [1.0, 2.0, 3.0, 3.5]},
         "wall clock 3.5 s reached --max-wall-s 3"),
    ],
)  # fmt: skip
def test_resume_refuses_a_run_its_stop_rule_ended(tmp_path, settings, log, match):
    """Resumed, it would stop after one more iteration: it is refused as a finished run is. A
    run whose rule was not met resumes."""
    cfg = config(tmp_path, policy="async", **settings)
    policy = build_policy(cfg, ("h",) * 4)
    with pytest.raises(ConfigError, match=f"has already stopped: its {match}"):
        check_resumable({**resumable("async"), "log": log}, cfg, cfg.engine_settings("r"),
                        policy)  # fmt: skip
    early = {k: v[:1] for k, v in log.items()} | {"loss": [3.0]}
    check_resumable({**resumable("async"), "log": early}, cfg, cfg.engine_settings("r"),
                    policy)  # fmt: skip


def test_an_asynchronous_policy_on_a_gpu_is_refused(tmp_path):
    cfg = config(tmp_path, policy="async", device="cuda")
    with pytest.raises(ConfigError, match="runs on CPU only"):
        check_asynchronous(cfg.engine_settings("r"), build_policy(cfg, ("h",) * 4))


def test_the_run_config_holds_absolute_paths(tmp_path, monkeypatch):
    """A run resumed from another working directory uses the same trace store."""
    monkeypatch.chdir(tmp_path)
    written = TrainConfig(workers=2, iterations=3, policy="full", traces=Path("t"),
                          out=Path("o"), stragglers="replay:r").to_json()  # fmt: skip
    assert (written["traces"], written["out"]) == (str(tmp_path / "t"), str(tmp_path / "o"))
    assert written["stragglers"] == f"replay:{tmp_path / 'r'}"


def test_config_round_trips_through_the_run_dir(tmp_path):
    cfg = config(tmp_path, target_loss=0.5)
    cfg.out.mkdir()
    (cfg.out / "config.json").write_text(json.dumps(cfg.to_json()))
    assert resume_config(cfg.out) == cfg
    assert resume_config(cfg.out, iterations=20).iterations == 20


def test_resume_without_state_is_refused(tmp_path):
    with pytest.raises(CheckpointError):
        load_state(tmp_path)
    with pytest.raises(ConfigError, match=r"not a train run directory \(no config.json\)"):
        resume_config(tmp_path)


def test_async_resume_continues_after_every_row_written(tmp_path, trace_rows):
    """Rows written after the checkpoint (the server was killed later) are kept: each worker's
    next computation comes after its last row; adasync's schedule counts the logged updates."""
    rows = trace_rows(iterations=5, workers=2, run_id="r")
    cells = zip(rows["iteration"], rows["worker"], strict=True)
    keep = [i for i, (t, w) in enumerate(cells) if w == 0 or t < 2]
    TraceStore(tmp_path / "t").append({k: [v[i] for i in keep] for k, v in rows.items()})
    policy = build_policy(config(tmp_path, policy="adasync:2", workers=2), ("h",) * 2)
    state = {"live": [True, True], "next_j": [3, 1], "log": {"workers": [2, 2, 2]}}
    replay_async_history(policy, tmp_path / "t", "r", state)
    assert state["next_j"] == [5, 2]
    assert policy.applied == 1 + 1 + 2  # K of the three logged updates
