"""Starting and stopping a parameter-server run: the control store, N spawned worker processes
(or torchrun's other ranks), the server loop in this process, periodic checkpoints, and a
shutdown that leaves no process behind (stop keys, bounded joins, then kill).

The parameter server runs the asynchronous policies (``k-async:K``, ``async``, ``adasync``) only:
their stragglers keep computing and their gradients land late, which an all-reduce cannot do.
Every synchronous policy runs on the library's loop (:mod:`bdsgd.stages.loop`)."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from bdsgd.stages.engine.async_server import AsyncServer
from bdsgd.stages.engine.async_worker import async_worker_main
from bdsgd.stages.engine.base import Engine, StopRun
from bdsgd.stages.engine.config import EngineConfig
from bdsgd.stages.engine.resume import Checkpointer
from bdsgd.stages.engine.worker import WorkerSpec, default_bind_host
from bdsgd.stages.errors import CheckpointError, ConfigError, WorkerError
from bdsgd.stages.policies.base import Policy
from bdsgd.stages.signals import default_sigterm
from bdsgd.stages.store import TraceStore, TraceWriter
from bdsgd.stages.wire import keys as P
from bdsgd.stages.wire import spawned
from bdsgd.stages.wire.spawned import join_or_kill
from bdsgd.stages.wire.torchrun import Torchrun
from bdsgd.stages.workloads import load_workload

FAILED_GRACE_S = 2.0  # after an error: how long the workers get to stop before they are killed
MAX_PENDING_ROWS = 1 << 15  # trace rows the writer holds before it writes a file unasked


def check_asynchronous(cfg: EngineConfig, policy: Policy) -> None:
    """The parameter server runs asynchronous policies on CPU only."""
    if policy.mode != "k-async":
        raise ConfigError(f"policy {policy.name!r} is synchronous: it runs on the library's loop")
    if cfg.device == "cuda":
        raise ConfigError(
            f"{policy.name} applies stale gradients through a parameter server: it runs on CPU "
            "only (no --device cuda)"
        )


@dataclass
class EngineResult:
    log: dict[str, list]
    dead_workers: dict[int, int]  # worker -> iteration it was declared dead
    rows_written: int
    trace_files: list[Path]
    interrupted: bool
    final_eval_loss: float | None
    extras: dict  # what the engine adds to the summary


def run_engine(
    cfg: EngineConfig,
    policy: Policy,
    traces: Path,
    on_iteration: Callable[[int, dict], None],
    run_dir: Path | None = None,
    resume: dict | None = None,
) -> EngineResult:
    """Run iterations ``[start, cfg.iterations)``; the engine loop is this process."""
    P.quiet_c10d_logs()
    torch.set_num_threads(1)  # the engine shares the machine with its workers; decisions stay fast
    check_asynchronous(cfg, policy)
    tr = Torchrun.from_env()
    if tr:
        cfg = server_config(tr, cfg)
        c10d = P.open_store(tr.addr, tr.port, not tr.agent_store, cfg.timeout_s)
    else:
        c10d = P.open_store(cfg.host, 0, True, cfg.timeout_s)
        cfg = dataclasses.replace(cfg, host=advertised_host(cfg.host))
    start = int(resume["next_iteration"]) if resume else 0
    workload = load_workload(cfg.workload, seed=cfg.seed)
    if fields := workload.loop_only():
        raise ConfigError(f"workload {cfg.workload!r} sets {', '.join(fields)}: the parameter "
                          "server trains with its own SGD; train it with a synchronous policy")  # fmt: skip
    c10d.set(P.START_KEY, str(start))
    c10d.set(P.T0_KEY, repr(time.time()))
    writer = TraceWriter(TraceStore(traces), batch_rows=MAX_PENDING_ROWS)
    engine = AsyncServer(cfg, c10d, workload, policy, writer, alive=lambda w: True)
    if resume:
        engine.load_state(resume)
    procs: list[mp.Process] = []
    interrupted = failed = False
    ckpt = None if run_dir is None else Checkpointer(run_dir, resume_segments(resume))
    # after a stop, what the workers run anyway is recorded, its rows shown, not judged again
    announced = _with_checkpoints(engine, _stop_ignored(on_iteration), ckpt)
    try:
        if not tr:  # (torchrun: timeouts tell)
            engine.alive = lambda w: w < len(procs) and procs[w].is_alive()
            spawn_workers(cfg, c10d.port, async_worker_main, procs)
        engine.run(start, _with_checkpoints(engine, on_iteration, ckpt))
        engine.run_announced(announced)
    except KeyboardInterrupt:
        interrupted = True  # the caller writes what it has, then reports the interrupt
        # best effort: another Ctrl-C, or a failure, ends it with what it recorded so far
        with contextlib.suppress(KeyboardInterrupt, Exception):
            engine.run_announced(announced)
    except BaseException:
        failed = True  # an error on its way to the caller
        raise
    finally:
        engine.finish(max(engine.current, start))  # also during start-up
        engine.janitor.close()
        kill_unstarted(procs, c10d)
        kill_declared_dead(procs, engine.dead_at)
        # a loaded machine is slow to stop; after an error the workers may wait on a message
        # the engine will not send (the parameters of the next iteration), and hold nothing
        # the run still needs (the engine collected what they publish in finish)
        join_or_kill(procs, grace_s=FAILED_GRACE_S if failed else max(10.0, cfg.timeout_s))
        close_records(engine, ckpt, start)
    return EngineResult(
        engine.log.rows,
        engine.dead_at,
        writer.rows_written,
        writer.files,
        interrupted,
        engine.final_loss(),
        engine.extras(),
    )


def spawn_workers(cfg: EngineConfig, port: int, main, procs: list[mp.Process]) -> None:
    """Start the workers (into ``procs``, so a Ctrl-C midway leaves every started one to reap),
    each through :func:`bdsgd.stages.wire.spawned.run`, which ignores SIGINT before it imports
    ``main``'s module."""
    ctx = mp.get_context("spawn")
    target = f"{main.__module__}:{main.__qualname__}"
    for w in range(cfg.workers):
        spec = pickle.dumps(WorkerSpec(w + 1, cfg.host, port, cfg.host, cfg, local_rank=w))
        proc = ctx.Process(target=spawned.run, args=(target, spec), name=f"bdsgd-worker-{w}",
                           kwargs={"exit_at_once": True}, daemon=True)  # fmt: skip
        proc.start()
        procs.append(proc)


def check_world(tr: Torchrun, workers: int) -> None:
    """Under torchrun rank 0 runs the parameter server: the workers are the other ranks."""
    if workers != tr.world_size - 1:
        raise ConfigError(
            f"under torchrun --workers must be the world size minus one (rank 0 runs the "
            f"parameter server): {tr.world_size - 1}, got {workers}"
        )


def server_config(tr: Torchrun, cfg: EngineConfig) -> EngineConfig:
    """Other machines must reach rank 0's sockets (the parameter server's gloo group):
    loopback, or a wildcard (which gloo cannot bind), becomes this host's address."""
    check_world(tr, cfg.workers)
    host = default_bind_host() if cfg.host in ("127.0.0.1", *WILDCARDS) else cfg.host
    return dataclasses.replace(cfg, host=host)


WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
"""``--host`` values that mean every interface, and the address the workers of one machine
reach such a store at (gloo binds a concrete interface, never a wildcard)."""


def advertised_host(host: str) -> str:
    """Where the spawned workers reach the control store and what every gloo socket binds:
    ``host``, or for a wildcard (the store listens on every interface) loopback."""
    return WILDCARDS.get(host, host)


def run_torchrun_worker(cfg: EngineConfig, tr: Torchrun) -> None:
    """Body of a worker rank under torchrun: the asynchronous worker loop."""
    check_world(tr, cfg.workers)
    P.quiet_c10d_logs()
    default_sigterm()  # (torchrun's agent ends its ranks with SIGTERM)
    try:
        wait_s = cfg.start_timeout_s + cfg.timeout_s  # (the engine rank may start last)
        P.open_store(tr.addr, tr.port, False, wait_s).get(P.START_KEY)
    except dist.DistError:
        raise WorkerError(f"no word from the engine within {wait_s:g} s") from None
    local_rank = int(os.environ.get("LOCAL_RANK", tr.rank - 1))
    spec = WorkerSpec(tr.rank, tr.addr, tr.port, default_bind_host(), cfg, local_rank)
    async_worker_main(spec)


def kill_unstarted(procs: list[mp.Process], c10d) -> None:
    """Workers that never reached the store (a failed start) have nothing to stop cleanly."""
    for w, proc in enumerate(procs):
        with contextlib.suppress(Exception):
            if proc.is_alive() and not c10d.check([P.ready_key(w)]):
                proc.kill()


def kill_declared_dead(procs: list[mp.Process], dead: dict[int, int]) -> None:
    """Workers the run declared dead (hung, or too slow to answer) are out of it: waiting for
    them to stop cleanly would cost the grace period for nothing (a stopped process never
    exits)."""
    for w in dead:
        if 0 <= w < len(procs) and procs[w].is_alive():
            with contextlib.suppress(Exception):
                procs[w].kill()


def _stop_ignored(on_iteration):
    def callback(t: int, row: dict) -> None:
        with contextlib.suppress(StopRun):
            on_iteration(t, row)

    return callback


def _with_checkpoints(engine: Engine, on_iteration, ckpt: Checkpointer | None):
    """After each iteration: the caller's callback, then, when :meth:`Engine.record_due`, the
    trace rows so far (one file) and, with a run directory, the checkpoint that counts them."""

    def callback(t: int, row: dict) -> None:
        on_iteration(t, row)
        if not engine.record_due(t):
            return
        if ckpt is None:
            engine.writer.flush()
            return
        ckpt.save(engine.state(t + 1), then=lambda: engine.flush_through(t))

    return callback


def close_records(engine: Engine, ckpt: Checkpointer | None, start: int) -> None:
    """The rows still pending and the last checkpoint land together or neither does: the
    checkpoint is written under its temporary name, the writer closed (every row on disk), then
    the checkpoint renamed into place. A checkpoint that cannot be written (a full disk) drops
    the pending rows, so the traces never run ahead of it and ``--resume`` continues after it
    with nothing missing and nothing twice."""
    if ckpt is None or engine.next_iteration <= start:
        engine.writer.close()
        return
    try:
        ckpt.save(engine.state(engine.next_iteration), then=engine.writer.close)
    except CheckpointError:
        engine.writer.abandon()
        raise


def resume_segments(resume: dict | None) -> int:
    """The iteration-log segments the run directory holds already (a resumed run)."""
    return int(resume.get("log_segments", 0)) if resume else 0
