"""The training loop ``bdsgd train`` (every synchronous policy) and ``bdsgd profile`` run on
each rank: a :class:`~bdsgd.stages.workloads.Workload` trained through :class:`bdsgd.Cutoff`, the
library a user puts in their own script, so the command line and a user's job share one path.

The workload's optimizer, LR scheduler, data, autocast dtype and clip norm are used where it
gives them (:class:`~bdsgd.stages.workloads.Workload`); the built-ins train with SGD and
momentum at a constant learning rate on batches drawn per rank. Like the rest of the rank side,
this module imports no coordinator, trace store, polars, pyarrow or rich.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.loop.config import LoopConfig
from bdsgd.stages.loop.group_exit import release_default_group
from bdsgd.stages.loop.rank import Cutoff
from bdsgd.stages.smoothing import ALPHA as SMOOTHING
from bdsgd.stages.wire import keys as P
from bdsgd.stages.workloads import (
    Workload,
    backend_for,
    error_line,
    load_workload,
    resolve_device,
)

PROGRESS_KEY = "bdsgd/progress"  # "<iterations done> <smoothed loss>", set by rank 0
STOP_KEY = "bdsgd/stop"  # set by the launcher (Ctrl-C): stop after an iteration, save, close
FAILED_KEY = "bdsgd/failed"  # ranks that failed
FAILURE_KEY = "bdsgd/failure"  # the first one's error, one line
PROGRESS_EVERY_S = 0.25  # rank 0 updates the progress key at most this often


@dataclass(frozen=True, kw_only=True)
class LoopJob:
    """One run of the loop on every rank: plain values only (it crosses the spawn boundary)."""

    loop: LoopConfig
    workload: str
    iterations: int
    batch_size: int
    lr: float
    device: str = "auto"
    eval_every: int = 10  # 0: no held-out evaluation (a profile)
    save_every: int = 25  # iterations between checkpoints (with a run directory)
    stop_at: float | None = None  # end once the smoothed training loss reaches it
    max_wall_s: float | None = None  # end once the run has trained this long (rank 0's clock)
    host: str = "127.0.0.1"  # the control store's address (spawned ranks)


@dataclass(frozen=True)
class RankSpec:
    """A spawned rank: its place and where the launcher's store listens."""

    job: LoopJob
    rank: int
    world: int
    port: int


def rank_main(spec: RankSpec) -> None:
    """Body of a rank spawned by :func:`bdsgd.stages.loop.local.run_local`: join the process
    group through the launcher's store, then run the loop."""
    job = spec.job
    P.quiet_c10d_logs()
    torch.set_num_threads(1)
    if job.host in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo listens on loopback too
    device = resolve_device(job.device, spec.world, spec.rank)
    store = P.open_store(job.host, spec.port, False, job.loop.timeout_s)
    dist.init_process_group(
        backend_for(device, spec.world), store=store, rank=spec.rank, world_size=spec.world,
        timeout=datetime.timedelta(seconds=job.loop.timeout_s),
    )  # fmt: skip
    try:
        run_rank(job, device, progress=store if spec.rank == 0 else None)
    except Exception as exc:  # noqa: BLE001 (one line for the launcher, not a traceback)
        report_failure(store, spec.rank, exc, job.loop.timeout_s)
        raise SystemExit(1) from None
    finally:
        end_group()


def end_group() -> None:
    """Destroy the process group, released first (a group that outlives this aborts the rank at
    exit: :mod:`~bdsgd.stages.loop.group_exit`); a group already broken is no error here."""
    with contextlib.suppress(Exception):
        release_default_group()
        dist.destroy_process_group()


def report_failure(store: dist.Store, rank: int, exc: BaseException,
                   timeout_s: float | None = None) -> None:  # fmt: skip
    """The first rank to fail leaves its error in the store for the launcher's one line (the
    others then fail on the broken group: their errors say less)."""
    line = f"rank {rank}: {collective_timeout_line(exc, timeout_s) or error_line(exc)}"
    with contextlib.suppress(Exception):
        if store.add(FAILED_KEY, 1) == 1:
            store.set(FAILURE_KEY, line)


COLLECTIVE_TIMEOUTS = ("Timed out waiting", "collective operation timeout", "Watchdog caught")


def collective_timeout_line(exc: BaseException, timeout_s: float | None) -> str | None:
    """What a gloo or NCCL collective's timeout means here, in one line (their own message
    names a C++ file): a rank did not reach the all-reduce within ``--timeout``."""
    text = str(exc)
    if not any(marker in text for marker in COLLECTIVE_TIMEOUTS):
        return None
    limit = f" ({timeout_s:g} s)" if timeout_s is not None else ""
    return (
        f"a collective waited longer than --timeout{limit} for another rank: one rank "
        "took that long in one iteration (a straggler that no cut ended) or stopped; "
        "raise --timeout if your iterations can take that long"
    )


def run_torchrun_rank(job: LoopJob) -> dict | None:
    """Body of a rank under ``torchrun``: every rank trains (the coordinator is a thread beside
    rank 0's loop); returns the summary on rank 0."""
    P.quiet_c10d_logs()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(job.device, int(os.environ["WORLD_SIZE"]), local)
    dist.init_process_group(
        backend_for(device, int(os.environ["WORLD_SIZE"])),
        timeout=datetime.timedelta(seconds=job.loop.timeout_s),
    )
    try:
        return run_rank(job, device)
    finally:
        end_group()


def run_rank(job: LoopJob, device: torch.device, progress: dist.Store | None = None):
    """The loop itself on one rank; the summary on the coordinator's rank, else None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    workload = load_workload(job.workload, seed=job.loop.seed)
    model = workload.model.to(device)
    cut = Cutoff(model, job.loop)
    opt = workload.make_optimizer(job.lr)
    sched = workload.make_scheduler(opt, job.iterations)
    start = cut.resume(opt, sched) if job.loop.out else 0
    batches = workload.batches(rank, world, job.batch_size, job.loop.seed, start)
    report = Progress(progress, start)
    for t in range(start, job.iterations):
        one_iteration(cut, workload, opt, sched, to_device(next(batches), device))
        if rank == 0 and job.eval_every and (t + 1) % job.eval_every == 0:
            cut.log_eval(evaluate(workload, device))
        if job.loop.out and (t + 1) % job.save_every == 0 and t + 1 < job.iterations:
            cut.save(opt, sched)
        if report.after(t, cut.last.loss, job.stop_at) or cut.last.stop:
            break  # every rank: the loss and the stop are the all-reduced ones
        if report.stop_asked or over_budget(cut, job.max_wall_s):
            cut.request_stop()  # (it travels in the next all-reduce to every rank)
    if job.loop.out:
        cut.save(opt, sched)
    summary = cut.close()
    report.done(cut.t)
    return summary


def over_budget(cut: Cutoff, max_wall_s: float | None) -> bool:
    """The wall-clock budget is spent (read where the coordinator runs, rank 0)."""
    return (
        max_wall_s is not None
        and cut.coordinator is not None
        and (cut.coordinator.elapsed() >= max_wall_s)
    )


def one_iteration(cut: Cutoff, workload: Workload, opt, sched, batch) -> None:
    """The micro-batches under the cut, the all-reduce, clipping, the step and the schedule."""
    device = cut.device
    with cut.iteration() as it:
        for x, y in it.micro_batches(batch):
            with autocast(device, workload.autocast):
                loss = workload.loss(workload.model(x), y)
            it.backward(loss)
    if workload.clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(cut.params, workload.clip_norm)
    cut.step(opt)
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@torch.no_grad()
def evaluate(workload: Workload, device: torch.device) -> float:
    """The loss on the workload's held-out batch."""
    x, y = to_device(workload.eval_batch, device)
    workload.model.eval()
    try:
        with autocast(device, workload.autocast):
            return float(workload.loss(workload.model(x), y))
    finally:
        workload.model.train()


def to_device(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    raise ConfigError(f"a batch of type {type(batch).__name__}: the workload must give tensors")


class Progress:
    """Rank 0's iterations so far, set in the launcher's store at most every
    ``PROGRESS_EVERY_S`` (its progress bar reads them; rank 0 then also looks for the
    launcher's stop), and the smoothed training loss that ``stop_at`` is compared with on every
    rank."""

    def __init__(self, store: dist.Store | None, start: int) -> None:
        self.store, self.smooth, self.last_set = store, None, 0.0
        self.stop_asked = False  # the launcher asked the job to stop (rank 0 reads it)
        self._set(start)

    def after(self, t: int, loss: float | None, stop_at: float | None) -> bool:
        if loss is not None:
            a = SMOOTHING
            self.smooth = loss if self.smooth is None else (1 - a) * self.smooth + a * loss
        if self.store is not None and time.monotonic() - self.last_set >= PROGRESS_EVERY_S:
            self._set(t + 1)
            self.stop_asked = self.stop_asked or self.store.check([STOP_KEY])
        return stop_at is not None and self.smooth is not None and self.smooth <= stop_at

    def done(self, t: int) -> None:
        self._set(t)

    def _set(self, t: int) -> None:
        if self.store is None:
            return
        self.last_set = time.monotonic()
        loss = "nan" if self.smooth is None else repr(self.smooth)
        self.store.set(PROGRESS_KEY, f"{t} {loss}")


def with_loop(job: LoopJob, **changes) -> LoopJob:
    """``job`` with some of its :class:`LoopConfig` fields changed."""
    return dataclasses.replace(job, loop=dataclasses.replace(job.loop, **changes))
