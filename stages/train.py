"""``bdsgd train``: distributed SGD over torch.distributed under a policy.

A synchronous policy (``full``, ``static:C``, ``elfving``, ``ecdf``, ``ewma``, ``bdsgd``, ...)
runs on the library's loop (:mod:`bdsgd.stages.loop_runs`): every rank trains, and the first c
gradients of an iteration are summed in one all-reduce. An asynchronous policy (``k-async:K``,
``async``, ``adasync``) runs on the parameter server (:mod:`bdsgd.stages.engine`): it applies
every K arrivals while the stragglers keep computing and land late.

This module holds the config both take, the asynchronous path's run directory (its resume state,
iteration log and summary), the stop rule and ``time_to_loss``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from bdsgd.schemas.run_dir import iterations_table, write_run_dir
from bdsgd.stages.capacity import check_capacity
from bdsgd.stages.console import console, progress
from bdsgd.stages.engine.base import STATE_VERSION, StopRun
from bdsgd.stages.engine.config import EngineConfig, engine_config
from bdsgd.stages.engine.launch import (
    EngineResult,
    check_asynchronous,
    run_engine,
    run_torchrun_worker,
)
from bdsgd.stages.engine.resume import STATE_FILE, state_path, with_whole_log
from bdsgd.stages.errors import BdsgdError, CheckpointError, ConfigError
from bdsgd.stages.loop.config import LR_SCALINGS
from bdsgd.stages.policies.base import Policy, observe_run
from bdsgd.stages.policies.registry import make_policy
from bdsgd.stages.policies.selfcheck import lean_message, self_check_report
from bdsgd.stages.profile import check_micro_batches, engine_hosts
from bdsgd.stages.run_dir import LOCKED_ENV, holds_run, open_new_run, open_resumed_run
from bdsgd.stages.safe_load import load_plain
from bdsgd.stages.smoothing import SmoothedLoss
from bdsgd.stages.store import TraceStore, new_run_id
from bdsgd.stages.summary import run_summary
from bdsgd.stages.wire.torchrun import Torchrun
from bdsgd.stages.workloads import BUILTIN

CONFIG_FILE = "config.json"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    workers: int
    """Number of worker processes N."""
    iterations: int
    """Total iterations T of the run (updates, for the asynchronous policies; a resumed run
    continues up to T)."""
    policy: str
    """full, static:C, elfving, ecdf, ewma, bdsgd (cutoff) or k-async:K, async, adasync[:G]."""
    traces: Path
    """Trace store the run's rows (censored ones included) are appended to."""
    out: Path
    """Run directory: config, server checkpoint, iterations.parquet, summary.json."""
    checkpoint: Path | None = None
    """Fitted run-time model (needed by ``bdsgd``)."""
    stragglers: str = "none"
    """none, synthetic[:k=v,...] or replay:PATH."""
    time_scale: float = 1.0
    """Multiplier on injected delays."""
    workload: str = "mlp"
    """mlp, cnn or module:function."""
    batch_size: int = 32
    """Mini-batch size per worker."""
    micro_batches: int = 4
    """Micro-batches per mini-batch: where a cut-off computation stops."""
    device: str = "auto"
    """auto, cpu or cuda: where the ranks compute (cuda: one GPU per rank, NCCL)."""
    salvage: bool = True
    """A cut rank contributes the micro-batches it finished (synchronous policies)."""
    lr: float = 0.05
    """Learning rate when every live worker's gradient is applied."""
    lr_scaling: str = "auto"
    """How the learning rate follows c: linear (lr*c/N), sqrt (lr*sqrt(c/N)), none, adascale
    (lr*gain(c)/gain(N) from the gradient noise scale, ``bdsgd.stages.goodput.adascale_factor``),
    or auto: sqrt for an Adam-type optimizer (a workload's own), else linear."""
    seed: int = 0
    """Seed of the workload, the data streams, the stragglers and the policy."""
    target_loss: float | None = None
    """Smoothed training loss whose first crossing gives ``time_to_loss``."""
    stop_at_target: bool = False
    """End the run once the smoothed training loss reaches ``target_loss`` (before T if need be)."""
    max_wall_s: float | None = None
    """End the run once its wall clock passes this many seconds (after the iteration under way;
    a resumed run counts the seconds it already ran); None: no budget."""
    min_workers: int = 1
    """Asynchronous policies: stop with an error when fewer workers than this remain alive."""
    max_restarts: int = 1
    """Synchronous policies on one machine: times the job restarts from its last checkpoint
    when a rank dies (0: never)."""
    overhead_s: float | None = None
    """Fixed cost per iteration fed to the policy; None measures it while running."""
    explore: float = 0.0
    """Fraction of iterations in which a learning cutoff policy waits for every worker."""
    record_batch: int = 25
    """The trace rows and the checkpoint are written after every ``record_batch``-th iteration
    (and at the end) ..."""
    record_s: float = 2.0
    """... at most once per this many seconds (0: after every ``record_batch``-th): fast
    iterations make one trace file and one checkpoint per ``record_s``, not per 25 iterations."""
    eval_every: int = 10
    """Iterations between held-out loss evaluations."""
    host: str = "127.0.0.1"
    """Address the server binds to."""
    timeout_s: float = 60.0
    """Longest wait on another process before it is declared dead."""
    start_timeout_s: float = 300.0
    """Longest wait for the workers to start (import torch, load the workload): on a loaded
    machine or a shared filesystem that takes far longer than any wait in a run."""
    allow_oversubscribe: bool = False
    """Start more workers than this machine runs (:mod:`bdsgd.stages.capacity`)."""
    force: bool = False
    """Write into an ``out`` that is neither empty nor a new path (a previous run's files there
    are replaced)."""
    run_id: str | None = None
    """The run whose checkpoints the run directory holds: not a flag, set when the directory is
    made, read back by ``--resume`` (None in a directory written before it was)."""

    def __post_init__(self) -> None:
        if self.workers < 1 or self.iterations < 1:
            raise ConfigError("--workers and --iterations must be >= 1")
        if self.lr_scaling not in LR_SCALINGS:
            raise ConfigError(
                f"--lr-scaling must be one of {', '.join(LR_SCALINGS)}, got {self.lr_scaling!r}"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not 1 <= self.min_workers <= self.workers:
            raise ConfigError(f"--min-workers must be in 1..{self.workers}")
        timeouts = (("--timeout", self.timeout_s), ("--start-timeout", self.start_timeout_s))
        for flag, value in (("--lr", self.lr), ("--time-scale", self.time_scale), *timeouts):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag} must be a finite number > 0, got {value}")
        if self.record_batch < 1 or self.eval_every < 1:
            raise ConfigError("record_batch and eval_every must be >= 1")
        if not (math.isfinite(self.record_s) and self.record_s >= 0):
            raise ConfigError(f"record_s must be a finite number >= 0, got {self.record_s}")
        check_micro_batches(self.batch_size, self.micro_batches)
        if not 0.0 <= self.explore < 1.0:
            raise ConfigError(f"--explore must be in [0, 1), got {self.explore}")
        if self.stop_at_target and self.target_loss is None:
            raise ConfigError("--stop-at-target needs --target-loss")
        if self.overhead_s is not None and not (
            math.isfinite(self.overhead_s) and self.overhead_s >= 0
        ):
            raise ConfigError(f"--overhead-s must be a finite number >= 0, got {self.overhead_s}")
        if self.target_loss is not None and not math.isfinite(self.target_loss):
            raise ConfigError(f"--target-loss must be a finite number, got {self.target_loss}")
        if self.max_wall_s is not None and not (
            math.isfinite(self.max_wall_s) and self.max_wall_s > 0
        ):
            raise ConfigError(f"--max-wall-s must be a finite number > 0, got {self.max_wall_s}")

    def engine_settings(self, run_id: str) -> EngineConfig:
        hosts = engine_hosts(self.stragglers, self.seed, self.time_scale, self.workers)
        return engine_config(self, run_id=run_id, source="train", hosts=hosts)

    def to_json(self) -> dict:
        """Paths absolute: a run resumed from another working directory finds the same ones."""
        values = {
            k: (str(v.absolute()) if isinstance(v, Path) else v)
            for k, v in dataclasses.asdict(self).items()
        }
        if self.stragglers.startswith("replay:"):
            values["stragglers"] = "replay:" + str(
                Path(self.stragglers[len("replay:") :]).absolute()
            )
        return values

    @classmethod
    def from_json(cls, data: dict, **overrides) -> TrainConfig:
        paths = {"traces", "out", "checkpoint"}
        values = {k: (Path(v) if k in paths and v is not None else v) for k, v in data.items()}
        return cls(**{**values, **overrides})


def run_train(cfg: TrainConfig, resume: bool = False) -> dict | None:
    """Run (or, with ``resume``, continue) a training run; returns the summary (None on a
    torchrun rank other than 0, which only trains)."""
    tr = Torchrun.from_env()
    if tr is None:
        check_capacity(cfg.workers, cfg.allow_oversubscribe)
    if not is_asynchronous(cfg.policy):
        from bdsgd.stages.loop_runs import train_on_loop

        return train_on_loop(cfg, resume, tr)
    if tr and tr.rank > 0:
        return run_torchrun_worker(cfg.engine_settings("worker"), tr)
    return train_holding(cfg, resume)


ASYNC_KINDS = ("async", "k-async", "adasync")


def is_asynchronous(policy: str) -> bool:
    """Whether ``policy`` runs on the parameter server (stale gradients applied late)."""
    return policy.partition(":")[0] in ASYNC_KINDS


def train_holding(cfg: TrainConfig, resume: bool) -> dict:
    """:func:`run_train` of an asynchronous policy on this machine's server process, holding
    the run directory (:class:`RunDir`) from before it reads the checkpoint to the end."""
    with RunDir(cfg, resume) as run_dir:
        state = load_state(cfg.out) if resume else None
        run_id = state["run_id"] if state else new_run_id("train")
        engine_cfg = cfg.engine_settings(run_id)  # everything is checked before it is written
        policy = build_policy(cfg, engine_cfg.hosts)
        check_asynchronous(engine_cfg, policy)
        if state:
            check_resumable(state, cfg, engine_cfg, policy)
        run_dir.start(run_id)
        return train_in(cfg, engine_cfg, policy, state)


class RunDir:
    """A train's hold on its run directory, for the run's whole length: the lock, taken before
    anything there is read (:mod:`bdsgd.stages.run_dir`); a new run's config written once every
    check passed (:meth:`start`); on a failure or Ctrl-C before the first checkpoint, the run
    directory and an empty trace store undone, so a refused run leaves nothing."""

    def __init__(self, cfg: TrainConfig, resume: bool) -> None:
        self.cfg, self.resume = cfg, resume
        self.lock = self.undo = self.undo_store = None

    def __enter__(self) -> RunDir:
        if self.resume:
            if not self.cfg.out.is_dir():
                raise CheckpointError(f"{self.cfg.out} is not a run directory: nothing to resume")
            self.lock = open_resumed_run(self.cfg.out)
        return self

    def start(self, run_id: str) -> None:
        """A new run's directory (checked, locked, its config written); the trace store checked."""
        if not self.resume:
            config = dataclasses.replace(self.cfg, run_id=run_id).to_json()
            self.lock, self.undo = open_new_run(self.cfg.out, config, self.cfg.force)
        self.undo_store = TraceStore(self.cfg.traces).check_writable()

    def __exit__(self, kind, exc, tb) -> None:
        failed = kind is not None and issubclass(kind, (BdsgdError, KeyboardInterrupt))
        if failed and self.undo_store:
            self.undo_store()  # (no empty trace store is left; first: it may share a new parent)
        if failed and self.undo and not holds_run(self.cfg.out):
            self.lock.release()
            self.undo()  # rejected or interrupted before its first checkpoint: nothing is left
        if self.lock is not None:
            self.lock.release()
        os.environ.pop(LOCKED_ENV, None)


def train_in(cfg: TrainConfig, engine_cfg: EngineConfig, policy: Policy, state: dict | None):
    """The run itself, in a prepared run directory."""
    run_id = engine_cfg.run_id
    if state:
        if policy.mode == "k-async":
            replay_async_history(policy, cfg.traces, run_id, state)
        else:
            state["next_iteration"] = replay_history(
                policy, cfg.traces, run_id, state["next_iteration"]
            )
    stop = StopRule(cfg, state["log"] if state else None)
    ran_before = len(state["log"].get("iteration", [])) if state else 0
    result = run_with_live_view(cfg, engine_cfg, policy, state, stop)
    if result.interrupted and len(result.log.get("iteration", [])) == ran_before:
        raise KeyboardInterrupt  # during start-up: no iteration ran, the run dir stays as it was
    summary = summarize(cfg, run_id, result, stop.reason)
    if (checked := self_check_report(policy)) is not None:  # bdsgd: did it lean on a peer?
        summary["self_check"] = checked
        if message := lean_message(policy.name, checked):
            console.print(message)
    write_run_dir(cfg.out, summary, iterations_table(result.log))
    if result.interrupted:
        raise KeyboardInterrupt
    return summary


def build_policy(cfg: TrainConfig, hosts: tuple[str, ...]) -> Policy:
    policy = make_policy(
        cfg.policy,
        cfg.workers,
        cfg.checkpoint,
        list(hosts),
        seed=cfg.seed,
        iterations=computations_per_worker(cfg.iterations, cfg.workers),
        overhead_s=cfg.overhead_s or 0.0,
        explore=cfg.explore,
    )
    if policy.mode == "k-batch-sync":
        raise ConfigError(
            f"bdsgd train does not run {cfg.policy!r} yet (k-batch-sync); compare it with bdsgd "
            "simulate, or train with k-async:K, async, adasync or a cutoff policy"
        )
    if cfg.policy == "oracle":
        raise ConfigError("the oracle policy exists only in simulation")
    return policy


def computations_per_worker(updates: int, workers: int) -> int:
    """The computations per worker of an adasync run of ``updates`` updates (what ``make_policy``
    sizes adasync's stages with): K doubles from 1 to N over s = ceil(log2 N) + 1 stages of P
    gradients each, that is P * (2 - 2^(1-s)) updates, so the run's N * T' gradients are s * P
    with P = updates / (2 - 2^(1-s)). Only adasync reads it."""
    stages = math.ceil(math.log2(workers)) + 1
    period = updates / (2 - 2 ** (1 - stages))
    return max(1, math.ceil(period * stages / workers))


def load_state(run_dir: Path) -> dict:
    """The parameter server's resume state in a run directory (tensors and plain values only)."""
    path = state_path(run_dir)
    if not path.is_file():
        raise CheckpointError(f"{run_dir} has no {STATE_FILE}: nothing to resume")
    state = load_plain(path, "parameter-server checkpoint")
    if state.get("version") != STATE_VERSION:
        raise CheckpointError(
            f"{path}: not a bdsgd parameter-server checkpoint of version "
            f"{STATE_VERSION} (written by another bdsgd: start "
            "a new run)"
        )
    return with_whole_log(run_dir, state)


def check_resumable(state: dict, cfg: TrainConfig, engine: EngineConfig, policy: Policy) -> None:
    """The checkpoint was written by the parameter server, for as many workers
    as the config says, enough of them alive, and iterations are left to run (a finished run is
    not run again: its summary stays)."""
    path, kind = state_path(cfg.out), "async"
    if cfg.run_id is not None and state.get("run_id") != cfg.run_id:
        raise CheckpointError(
            f"{path} belongs to run {state.get('run_id')}, not to {cfg.run_id}, which "
            f"{cfg.out / CONFIG_FILE} was started for: it was copied from another run directory"
        )
    if state.get("engine") != kind:
        raise CheckpointError(
            f"{path} was written by the {state.get('engine')} engine, not by the {kind} engine "
            f"that runs policy {policy.name!r}"
        )
    live = state.get("live")
    if not isinstance(live, list) or len(live) != cfg.workers:
        raise CheckpointError(
            f"{path} is not this run's: it holds {len(live) if isinstance(live, list) else 'no'} "
            f"workers, the run's {CONFIG_FILE} says {cfg.workers}"
        )
    if sum(map(bool, live)) < cfg.min_workers:
        raise CheckpointError(
            f"{path}: only {sum(map(bool, live))} worker(s) were left at the checkpoint, fewer "
            f"than the run's --min-workers {cfg.min_workers}"
        )
    if int(state.get("next_iteration", 0)) >= cfg.iterations:
        raise ConfigError(
            f"{cfg.out} has already run {int(state['next_iteration'])} iterations: pass "
            f"--iterations above that to extend it"
        )
    if (reason := StopRule(cfg, state.get("log")).met()) is not None:
        raise ConfigError(f"{cfg.out} has already stopped: {reason} (a resumed run keeps them)")


def replay_async_history(policy: Policy, traces: Path, run_id: str, state: dict) -> None:
    """Bring an asynchronous run's policy and computation counters up to the checkpoint: the
    policy chooses K again for every update in the log (adasync's schedule counts them), and each
    worker's next computation comes after every row the run already wrote (rows written after
    the checkpoint stay; the updates they fed are redone)."""
    workers = len(state["live"])
    for live in state["log"].get("workers", []):
        policy.choose(np.arange(workers) < live)
    run = TraceStore(traces).run_matrix(run_id, missing_ok=True)
    if run is not None:
        rows = run.present.shape[0]
        written = np.where(run.present.any(axis=0), rows - np.argmax(run.present[::-1], 0), 0)
        state["next_j"] = np.maximum(state["next_j"], written[:workers]).tolist()


def replay_history(policy: Policy, traces: Path, run_id: str, next_iteration: int) -> int:
    """Feed the policy what the run already observed (its rows in the store); returns the
    iteration to continue from: after the checkpoint and after every row already written."""
    run = TraceStore(traces).run_matrix(run_id, missing_ok=True)
    if run is None:
        return next_iteration
    observe_run(policy, run)
    return max(next_iteration, run.shape[0])


def run_with_live_view(cfg, engine_cfg, policy, state, stop: StopRule) -> EngineResult:
    with progress() as bar:
        task = bar.add_task(f"train {policy.name}", total=cfg.iterations, status="")
        dropped, gradients, seconds = 0, 0, 0.0

        def on_iteration(t: int, row: dict) -> None:
            nonlocal dropped, gradients, seconds
            dropped += row["workers"] - row["c"]
            gradients, seconds = gradients + row["c"], seconds + row["iteration_s"]
            loss = f"{row['loss']:.3f}" if row["loss"] is not None else "-"
            late = (
                f"staleness {row['staleness']:.1f}"
                if policy.mode == "k-async"
                else f"dropped {dropped}"
            )
            rate = gradients / max(seconds, 1e-9)  # so far, as the summary's throughput
            bar.update(
                task,
                completed=t + 1,
                status=f"loss {loss}  c {row['c']}/{row['workers']}  {rate:.0f} grad/s  {late}",
            )
            stop(row)

        return run_engine(engine_cfg, policy, cfg.traces, on_iteration, cfg.out, state)


def summarize(
    cfg: TrainConfig, run_id: str, result: EngineResult, stopped: str = "iterations"
) -> dict:
    """SPEC's train JSON plus where things went; ``stopped``: why the run ended (the
    :class:`StopRule`'s reason, or ``interrupted``)."""
    log = result.log
    c = np.asarray(log.get("c", []), dtype=float)
    summary = run_summary(
        log, policy=cfg.policy, run_id=run_id, traces=str(cfg.traces),
        target_loss=cfg.target_loss, rows_appended=result.rows_written,
        final_eval=result.final_eval_loss, world_size=cfg.workers,
        stopped="interrupted" if result.interrupted else stopped,
        dead_workers={str(k): v for k, v in result.dead_workers.items()},
        interrupted=result.interrupted, **result.extras,
    )  # fmt: skip
    if result.dead_workers:
        console.print(f"[yellow]workers {sorted(result.dead_workers)} died and were excluded[/]")
    console.print(
        f"{summary['policy']} (parameter server): {summary['throughput']:.1f} gradients/s, mean c "
        f"{summary['mean_c']:.2f}, final loss {summary['final_loss'] or float('nan'):.3f}, "
        f"{summary['rows_appended']} rows appended to {cfg.traces}, run in {cfg.out}"
    )
    if summary["stopped"] in ("target", "wall budget"):
        console.print(f"stopped after {c.size} iterations: {summary['stopped']} reached")
    return summary


class StopRule:
    """When a run ends before its T iterations: ``--stop-at-target`` once the smoothed loss
    reaches ``--target-loss``, ``--max-wall-s`` once the wall clock passes the budget. Called
    with every iteration's row, it raises :class:`StopRun` then; :attr:`reason` says why the run
    ended (``iterations``, ``target`` or ``wall budget``). ``log``: a resumed run's iterations so
    far, so that its smoothed loss continues."""

    def __init__(self, cfg: TrainConfig, log: dict | None = None) -> None:
        self.target = cfg.target_loss if cfg.stop_at_target else None
        self.max_wall_s = cfg.max_wall_s
        self.loss = SmoothedLoss()
        self.reason = "iterations"
        for loss in (log or {}).get("loss", []):
            self.loss.add(loss)
        walls = (log or {}).get("wall_s") or []
        self.wall_s = walls[-1] if walls else 0.0  # (a resumed run's clock so far)

    def met(self) -> str | None:
        """Why the run of the log given to the constructor (a resumed one) would stop at once:
        its smoothed loss already reached ``--target-loss`` (with ``--stop-at-target``), or its
        wall clock ``--max-wall-s``; None if neither. (A run that stopped at its target may
        have recorded a few announced iterations after it, whose loss can lift the smoothed
        one back above it: that run resumes.)"""
        smooth = self.loss.value
        if self.target is not None and smooth is not None and smooth <= self.target:
            return f"its smoothed loss {smooth:.4g} reached --target-loss {self.target:g}"
        if self.max_wall_s is not None and self.wall_s >= self.max_wall_s:
            return f"its wall clock {self.wall_s:.1f} s reached --max-wall-s {self.max_wall_s:g}"
        return None

    def __call__(self, row: dict) -> None:
        smooth = self.loss.add(row.get("loss"))
        if self.target is not None and smooth is not None and smooth <= self.target:
            self.reason = "target"
        elif self.max_wall_s is not None and row["wall_s"] >= self.max_wall_s:
            self.reason = "wall budget"
        else:
            return
        raise StopRun


def resume_config(
    run_dir: Path,
    iterations: int | None = None,
    allow_oversubscribe: bool = False,
    workload: str | None = None,
) -> TrainConfig:
    """The config a run directory was started with (``--iterations`` may extend it,
    ``--allow-oversubscribe`` lift the worker limit). The run directory is not trusted to name
    code: a ``module:function`` workload runs only when ``workload`` (the command line's)
    names the same one."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a train run directory (no {CONFIG_FILE})")
    try:
        data = json.loads(path.read_text())
    except ValueError:
        raise ConfigError(f"{path} is not valid JSON") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a train config")
    check_resumed_workload(path, data.get("workload", "mlp"), workload)
    overrides: dict = {"out": run_dir}  # (where it is now: it may have been moved)
    if iterations:
        overrides["iterations"] = iterations
    if allow_oversubscribe:
        overrides["allow_oversubscribe"] = True
    try:
        return TrainConfig.from_json(data, **overrides)
    except TypeError as exc:  # a key missing or unknown
        raise ConfigError(f"{path} is not a train config: {exc}") from None


def check_resumed_workload(path: Path, written: str, given: str | None) -> None:
    """A resumed run's workload is the one the command line gives, when it names one; a
    ``module:function`` one must be given (importing it runs code)."""
    if given is not None and given != written:
        raise ConfigError(f"{path} names workload {written!r}, not --workload {given!r}")
    if given is None and written not in BUILTIN:
        raise ConfigError(
            f"{path} names workload {written!r}, which is code: pass --workload {written} with "
            "--resume to run it"
        )
