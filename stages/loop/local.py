"""Run the loop of :mod:`bdsgd.stages.loop.job` as N ranks on this machine: this process hosts
the c10d store (loopback unless the user names an address) and watches; it is no rank, and the
coordinator is a thread beside rank 0's loop, so every rank trains.

Each rank starts through :mod:`bdsgd.stages.wire.spawned` (SIGINT and SIGTERM ignored: a
Ctrl-C is this process's to handle: the ranks stop after one iteration, save and close; a second
Ctrl-C ends them at once). A rank that exits with an error, a start that takes longer
than ``start_timeout_s`` or a run whose progress stalls longer than twice the timeout ends every
rank (SIGKILL after a grace), and the error names the rank.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import time
from collections.abc import Callable

import torch.distributed as dist
from bdsgd.stages.errors import WorkerError
from bdsgd.stages.loop.job import (
    FAILURE_KEY,
    PROGRESS_KEY,
    STOP_KEY,
    LoopJob,
    RankSpec,
    rank_main,
)
from bdsgd.stages.wire import keys as P
from bdsgd.stages.wire import spawned
from bdsgd.stages.wire.spawned import join_or_kill

POLL_S = 0.1


def run_local(
    job: LoopJob, world: int, start_timeout_s: float, on_progress: Callable[[int, float], None]
) -> None:
    """Run ``job`` on ``world`` spawned ranks until every one exits; ``on_progress(t, loss)``
    with rank 0's iterations done and smoothed loss as they come. Raises :class:`WorkerError`
    when a rank fails; KeyboardInterrupt passes after every rank is ended."""
    P.quiet_c10d_logs()
    store = P.open_store(job.host, 0, True, job.loop.timeout_s)
    procs: list[mp.Process] = []
    grace_s = 0.0  # (a failure or a Ctrl-C: the checkpoint and the rows on disk agree already)
    try:
        spawn_ranks(job, world, store.port, procs)
        try:
            watch(procs, store, job.loop.timeout_s, start_timeout_s, on_progress)
        except KeyboardInterrupt:
            stop_gracefully(procs, store, job.loop.timeout_s, start_timeout_s, on_progress)
            raise
        grace_s = 10.0
    finally:
        join_or_kill(procs, grace_s=grace_s)


def stop_gracefully(procs, store, timeout_s: float, start_timeout_s: float, on_progress) -> None:
    """A Ctrl-C: every rank stops after the same iteration, saves and closes (rank 0 sees the
    stop key and its request travels in the next all-reduce); a second Ctrl-C, a failure or a
    stall ends them at once."""
    with contextlib.suppress(Exception):
        store.set(STOP_KEY, "1")
    with contextlib.suppress(KeyboardInterrupt, WorkerError):
        watch(procs, store, timeout_s, start_timeout_s, on_progress)


def spawn_ranks(job: LoopJob, world: int, port: int, procs: list[mp.Process]) -> None:
    ctx = mp.get_context("spawn")
    target = f"{rank_main.__module__}:{rank_main.__qualname__}"
    for rank in range(world):
        spec = pickle.dumps(RankSpec(job, rank, world, port))
        proc = ctx.Process(target=spawned.run, args=(target, spec), name=f"bdsgd-rank-{rank}",
                           daemon=True)  # fmt: skip
        proc.start()
        procs.append(proc)


def watch(procs, store: dist.Store, timeout_s: float, start_timeout_s: float, on_progress):
    """Until every rank exited: report progress; fail on a rank's error or a stall."""
    seen, changed = None, time.monotonic()
    while any(p.exitcode is None for p in procs):
        raise_if_failed(procs, store)
        now = progress_of(store)
        if now is not None and now != seen:
            seen, changed = now, time.monotonic()
            on_progress(*now)
        allowed = start_timeout_s + timeout_s if seen is None else 2 * timeout_s
        if time.monotonic() - changed > allowed:
            what = "started" if seen is None else f"advanced past iteration {seen[0]}"
            raise WorkerError(f"the ranks have not {what} within {allowed:g} s")
        for p in procs:
            p.join(POLL_S / len(procs))
    raise_if_failed(procs, store)  # (every rank may have exited between two looks)
    if (now := progress_of(store)) is not None and now != seen:
        on_progress(*now)


class RankDied(WorkerError):
    """A rank ended without an error of its own (killed, or its process exited): the job can
    restart from its last checkpoint."""


def raise_if_failed(procs, store: dist.Store) -> None:
    """:class:`WorkerError` with the first failed rank's line, if a rank exited non-zero
    (:class:`RankDied` when a rank was killed, or when it said nothing: not an error of
    bdsgd's or the workload's)."""
    if failed := [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]:
        killed = [r for r in failed if procs[r].exitcode < 0]
        if killed:  # (the others then fail on the broken group: theirs is not the cause)
            raise RankDied(f"rank {killed[0]} was killed by signal {-procs[killed[0]].exitcode}")
        line = failure_line(store)
        if line is not None:
            raise WorkerError(line)
        raise RankDied(f"rank {failed[0]} exited with code {procs[failed[0]].exitcode}")


def failure_line(store: dist.Store) -> str | None:
    """The first failed rank's own line, if one is set within a moment (it is set before the
    rank exits; another rank may have exited first)."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if store.check([FAILURE_KEY]):
                return store.get(FAILURE_KEY).decode()
        time.sleep(0.05)
    return None


def progress_of(store: dist.Store) -> tuple[int, float] | None:
    with contextlib.suppress(Exception):
        if store.check([PROGRESS_KEY]):
            t, loss = store.get(PROGRESS_KEY).decode().split()
            return int(t), float(loss)
    return None
