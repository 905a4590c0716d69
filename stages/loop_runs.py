"""``bdsgd train`` (synchronous policies) and ``bdsgd profile``: the command line as a client of
the library (:class:`bdsgd.Cutoff`). Every rank trains the workload in the loop of
:mod:`bdsgd.stages.loop.job` (its optimizer, scheduler, data, autocast and clipping); the
coordinator is a thread beside rank 0's loop, never a rank. On one machine this process starts
the ranks (:mod:`bdsgd.stages.loop.local`) and is none of them; under ``torchrun`` every rank runs
the loop and ``--workers`` is the world size.

What the loop does not do is refused with one line: asynchronous policies (the parameter server
runs them), ``--min-workers`` below N (a rank that dies ends the run; it resumes from the last
checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bdsgd.schemas.run_dir import write_atomic
from bdsgd.stages.console import console, progress
from bdsgd.stages.errors import BdsgdError, CheckpointError, ConfigError
from bdsgd.stages.loop.config import LoopConfig
from bdsgd.stages.loop.job import LoopJob, run_torchrun_rank
from bdsgd.stages.loop.local import RankDied, run_local
from bdsgd.stages.loop.rank import load_state
from bdsgd.stages.policies.registry import make_policy
from bdsgd.stages.policies.selfcheck import lean_message
from bdsgd.stages.store import TraceStore, new_run_id

CHECKPOINT = "checkpoint.pt"


def loop_job(cfg, run_id: str, policy: str, out: Path | None, **loop) -> LoopJob:
    """The job of a train or profile config (fields of the same name mean the same)."""
    get = lambda name, default=None: getattr(cfg, name, default)  # noqa: E731
    lr_scaling = get("lr_scaling", "auto")
    config = LoopConfig(
        policy=policy, checkpoint=None if get("checkpoint") is None else str(cfg.checkpoint),
        traces=str(cfg.traces), out=None if out is None else str(out),
        micro_batches=cfg.micro_batches, salvage=get("salvage", False), lr_scaling=lr_scaling,
        stragglers=cfg.stragglers, time_scale=cfg.time_scale, seed=cfg.seed, run_id=run_id,
        timeout_s=cfg.timeout_s, workload=cfg.workload, target_loss=get("target_loss"),
        batch_size=cfg.batch_size,
        overhead_s=get("overhead_s"), explore=get("explore", 0.0),
        record_every=get("record_batch", 25), **loop,
    )  # fmt: skip
    return LoopJob(
        loop=config, workload=cfg.workload, iterations=cfg.iterations, batch_size=cfg.batch_size,
        lr=get("lr", 0.05), device=cfg.device, eval_every=get("eval_every", 10),
        save_every=get("record_batch", 25), host=cfg.host,
        stop_at=cfg.target_loss if get("stop_at_target") else None,
        max_wall_s=get("max_wall_s"),
    )  # fmt: skip


def check_inputs(cfg) -> tuple[str, ...]:
    """What the ranks would fail on, checked here first (one line, nothing started): the
    stragglers spec and the workload; returns the trace host of each rank."""
    from bdsgd.stages.profile import engine_hosts
    from bdsgd.stages.workloads import load_workload, resolve_device

    LoopConfig(time_scale=cfg.time_scale, timeout_s=cfg.timeout_s, micro_batches=cfg.micro_batches)
    resolve_device(cfg.device, cfg.workers)  # (--device cuda without a GPU: said here)
    hosts = engine_hosts(cfg.stragglers, cfg.seed, cfg.time_scale, cfg.workers)
    load_workload(cfg.workload, seed=cfg.seed)
    return hosts


def check_loop_flags(cfg) -> None:
    """The flags a synchronous run does not take, one line each."""
    if getattr(cfg, "min_workers", 1) not in (1, cfg.workers):
        raise ConfigError("--min-workers: a synchronous run ends when a rank dies (it resumes "
                          "from its last checkpoint)")  # fmt: skip


# -- train ----------------------------------------------------------------------------------------
def train_on_loop(cfg, resume: bool, torchrun) -> dict | None:
    """``bdsgd train`` of a synchronous policy: this process holds the run directory (rank 0
    under torchrun; every other rank only trains)."""
    from bdsgd.stages.train import RunDir

    if torchrun is not None and torchrun.rank > 0:
        return run_torchrun_rank(loop_job(cfg, "worker", cfg.policy, cfg.out))
    with RunDir(cfg, resume) as run_dir:
        check_loop_flags(cfg)
        check_world(cfg, torchrun)
        state = resumable(cfg) if resume else None
        run_id = state["run_id"] if state else new_run_id("train")
        check_policy(cfg, cfg.policy)
        run_dir.start(run_id)
        try:
            job = loop_job(cfg, run_id, cfg.policy, cfg.out)
            summary = run_job(job, cfg, torchrun, f"train {cfg.policy}")
        except (BdsgdError, KeyboardInterrupt) as exc:
            mark_ended(cfg.out, "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
            raise
        return finish_train(cfg, summary)


def mark_ended(out: Path, how: str) -> None:
    """A run that did not finish says why in the summary of its last checkpoint."""
    path = out / "summary.json"
    try:
        summary = json.loads(path.read_text())
        summary.update(stopped=how, interrupted=how == "interrupted", complete=False)
        write_atomic(path, json.dumps(summary, indent=2).encode())
    except (OSError, ValueError):
        pass  # (none written yet, or the disk is full: the checkpoint's own stays)


def resumable(cfg) -> dict:
    """The run directory's loop checkpoint (``weights_only``), checked against the config."""
    path = cfg.out / CHECKPOINT
    if not path.is_file():
        raise CheckpointError(f"{cfg.out} has no {CHECKPOINT}: nothing to resume")
    state = load_state(path, cfg.workers)
    if cfg.run_id is not None and state.get("run_id") != cfg.run_id:
        raise CheckpointError(f"{path} belongs to run {state.get('run_id')}, not {cfg.run_id}")
    if int(state["next_iteration"]) >= cfg.iterations:
        raise ConfigError(f"{cfg.out} has already run {int(state['next_iteration'])} iterations: "
                          "pass --iterations above that to extend it")  # fmt: skip
    return state


def finish_train(cfg, summary: dict | None) -> dict | None:
    """The summary the coordinator wrote, with why the run ended, printed in one line."""
    if summary is None:
        return None  # (a torchrun rank other than 0)
    stopped = "iterations"
    if summary["iterations"] < cfg.iterations:
        budget = cfg.max_wall_s is not None and summary["wall_s"] >= cfg.max_wall_s
        stopped = "wall budget" if budget else "target"
    summary = {**summary, "stopped": stopped, "interrupted": False, "complete": True}
    write_atomic(cfg.out / "summary.json", json.dumps(summary, indent=2).encode())
    final = summary["final_loss"]
    console.print(
        f"{cfg.policy}: {summary['throughput']:.1f} gradients/s, mean c "
        f"{summary['mean_c']:.2f}, final loss {final if final is not None else float('nan'):.3f}, "
        f"{summary['rows_appended']} rows appended to {cfg.traces}, run in {cfg.out}"
    )
    if stopped != "iterations":
        console.print(f"stopped after {summary['iterations']} iterations: {stopped} reached")
    if message := lean_message(cfg.policy, summary.get("self_check")):
        console.print(message, soft_wrap=True)
    return summary


# -- profile --------------------------------------------------------------------------------------
def profile_on_loop(cfg, run_id: str, torchrun) -> int | None:
    """``bdsgd profile``: policy ``full`` measures every rank; returns the rows
    appended (None on a torchrun rank other than 0)."""
    check_loop_flags(cfg)
    check_world(cfg, torchrun)
    check_inputs(cfg)
    store = TraceStore(cfg.traces)
    before = rows_of(store, run_id)
    job = dataclasses.replace(loop_job(cfg, run_id, "full", None), eval_every=0)
    summary = run_job(job, cfg, torchrun, "profile")
    if torchrun is not None and summary is None:
        return None
    return rows_of(store, run_id) - before


def rows_of(store: TraceStore, run_id: str) -> int:
    if not store.files():
        return 0
    rows = store.read()
    return int((rows["run_id"] == run_id).sum())


# -- both -----------------------------------------------------------------------------------------
def check_world(cfg, torchrun) -> None:
    if torchrun is not None and cfg.workers != torchrun.world_size:
        raise ConfigError(f"under torchrun every rank trains: --workers must be "
                          f"the world size {torchrun.world_size}, got {cfg.workers}")  # fmt: skip


def check_policy(cfg, policy: str) -> None:
    """The inputs and the policy build (a missing model, an unknown name) before any rank
    starts."""
    hosts = check_inputs(cfg)
    with console.capture():  # what building it says, rank 0's coordinator says once it runs
        built = make_policy(policy, cfg.workers, cfg.checkpoint, list(hosts), seed=cfg.seed)
    if built.mode != "sync" or policy == "oracle":
        raise ConfigError(f"policy {policy!r} does not run on the loop (synchronous cutoff "
                          "policies do: full, static:C, elfving, ecdf, ewma, bdsgd, ...)")  # fmt: skip


def run_job(job: LoopJob, cfg, torchrun, title: str) -> dict | None:
    """The ranks of ``job``: spawned here, or this process as one of torchrun's."""
    if torchrun is not None:
        return run_torchrun_rank(job)
    with progress() as bar:
        task = bar.add_task(f"{title} on {cfg.workers} ranks", total=cfg.iterations, status="")

        def on_progress(t: int, loss: float) -> None:
            status = "" if loss != loss else f"loss {loss:.3f}"
            bar.update(task, completed=t, status=status)

        run_restarting(job, cfg, on_progress)
    if job.loop.out is None:
        return {}
    return read_summary(Path(job.loop.out))


def run_restarting(job: LoopJob, cfg, on_progress) -> None:
    """:func:`run_local`, restarted from the last checkpoint when a rank dies (killed, not an
    error of its own) up to ``max_restarts`` times; the resumed ranks skip the trace rows and
    log rows already written, so nothing is missing or repeated. A run without a checkpoint
    yet is not restarted (it would repeat what it wrote)."""
    restarts = getattr(cfg, "max_restarts", 0)
    for attempt in range(restarts + 1):
        try:
            return run_local(job, cfg.workers, cfg.start_timeout_s, on_progress)
        except RankDied as exc:
            out = job.loop.out
            if attempt == restarts or out is None or not (Path(out) / CHECKPOINT).exists():
                raise
            console.print(f"[yellow]{exc}: the job restarts from its last checkpoint "
                          f"(restart {attempt + 1} of {restarts})[/]", soft_wrap=True)  # fmt: skip


def read_summary(out: Path) -> dict:
    path = out / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BdsgdError(f"the ranks ended without a readable {path}: {exc}") from None
