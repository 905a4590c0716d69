"""Starting and stopping an engine run on one machine: the control store, N spawned worker
processes, the server loop in this process, periodic server checkpoints, and a shutdown that
leaves no process behind (stop keys, bounded joins, then terminate and kill).

The policy's ``mode`` picks the engine: ``sync`` policies run the cutoff server and workers
(``server.py``, ``worker.py``), ``k-async`` ones the asynchronous pair (``async_server.py``,
``async_worker.py``). Torchrun worker ranks learn the mode from the store."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from stages.engine import async_protocol as A
from stages.engine import protocol as P
from stages.engine.async_server import AsyncServer
from stages.engine.async_worker import async_worker_main
from stages.engine.server import EngineConfig, Server
from stages.engine.worker import WorkerSpec, default_bind_host, worker_main
from stages.errors import ConfigError, WorkerError
from stages.policies.base import Policy
from stages.safe_load import save_atomic
from stages.store import TraceStore, TraceWriter
from stages.workloads import load_workload

STATE_FILE = "server_state.pt"


@dataclass
class EngineResult:
    log: dict[str, list]
    dead_workers: dict[int, int]  # worker -> iteration it was declared dead
    rows_written: int
    trace_files: list[Path]
    interrupted: bool
    final_eval_loss: float


def run_engine(
    cfg: EngineConfig,
    policy: Policy,
    traces: Path,
    on_iteration: Callable[[int, dict], None],
    run_dir: Path | None = None,
    resume: dict | None = None,
) -> EngineResult:
    """Run iterations ``[start, cfg.iterations)``; the server is this process."""
    P.quiet_c10d_logs()
    torch.set_num_threads(1)  # the server shares the machine with its workers; decisions stay fast
    workload = load_workload(cfg.workload, seed=cfg.seed)
    tr = Torchrun.from_env()
    if tr:
        cfg = tr.server_config(cfg)
        store = P.open_store(tr.addr, tr.port, not tr.agent_store, cfg.timeout_s)
    else:
        store = P.open_store(cfg.host, 0, True, cfg.timeout_s)
    start = int(resume["next_iteration"]) if resume else 0
    asynchronous = policy.mode == "k-async"
    store.set(A.MODE_KEY, policy.mode)
    store.set("start_iteration", str(start))
    store.set("t0", repr(time.time()))
    writer = TraceWriter(TraceStore(traces), batch_rows=cfg.record_batch * cfg.workers)
    procs = [] if tr else spawn_workers(cfg, store.port, asynchronous)
    alive = (lambda w: True) if tr else (lambda w: procs[w].is_alive())  # torchrun: timeouts tell
    server_class = AsyncServer if asynchronous else Server
    server = server_class(cfg, store, workload, policy, writer, alive=alive)
    if resume:
        server.load_state(resume)
    interrupted = False
    try:
        server.run(start, _with_checkpoints(server, on_iteration, run_dir))
    except KeyboardInterrupt:
        interrupted = True  # the caller writes what it has, then reports the interrupt
    finally:
        if asynchronous:
            server.finish()  # stops the workers, writes what they still report
            join_or_kill(procs)
        else:
            stop_workers(store, procs, max(server.current, start))  # also during start-up
            server.collect_records(upto=server.current, final=True)
        writer.close()
        if run_dir is not None and server.next_iteration > start:
            save_state(run_dir, server.state(server.next_iteration))
    return EngineResult(
        server.log.rows,
        server.dead_at,
        writer.rows_written,
        writer.files,
        interrupted,
        server.evaluate(),
    )


def worker_spec(
    cfg: EngineConfig, worker_id: int, store_host: str, port: int, bind: str
) -> WorkerSpec:
    return WorkerSpec(
        worker_id=worker_id,
        num_workers=cfg.workers,
        store_host=store_host,
        store_port=port,
        bind_host=bind,
        workload=cfg.workload,
        batch_size=cfg.batch_size,
        micro_batches=cfg.micro_batches,
        stragglers=cfg.stragglers,
        time_scale=cfg.time_scale,
        seed=cfg.seed,
        iterations=cfg.iterations,
        record_batch=cfg.record_batch,
        timeout_s=cfg.timeout_s,
    )


def spawn_workers(cfg: EngineConfig, port: int, asynchronous: bool = False) -> list[mp.Process]:
    ctx = mp.get_context("spawn")
    main = async_worker_main if asynchronous else worker_main
    procs = []
    for w in range(cfg.workers):
        spec = worker_spec(cfg, w + 1, cfg.host, port, cfg.host)
        proc = ctx.Process(target=main, args=(spec,), name=f"bdsgd-worker-{w}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs


@dataclass(frozen=True)
class Torchrun:
    """This process's place in a ``torchrun`` launch: global rank 0 is the parameter server, every
    other rank a worker; the control store is torchrun's own (MASTER_ADDR:MASTER_PORT)."""

    rank: int
    world_size: int
    addr: str
    port: int
    agent_store: bool

    @staticmethod
    def from_env() -> Torchrun | None:
        env = os.environ
        if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            return None
        return Torchrun(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )

    def check(self, workers: int) -> None:
        if workers != self.world_size - 1:
            raise ConfigError(
                f"under torchrun --workers must be the world size minus one (rank 0 is the "
                f"server): {self.world_size - 1}, got {workers}"
            )

    def server_config(self, cfg: EngineConfig) -> EngineConfig:
        """Other machines must reach the server's gloo socket: loopback becomes this host."""
        self.check(cfg.workers)
        host = default_bind_host() if cfg.host == "127.0.0.1" else cfg.host
        return dataclasses.replace(cfg, host=host)


def run_torchrun_worker(cfg: EngineConfig, tr: Torchrun) -> None:
    """Body of a worker rank under torchrun; the server's policy mode (in the store) says which
    worker loop to run."""
    tr.check(cfg.workers)
    P.quiet_c10d_logs()
    try:
        mode = P.open_store(tr.addr, tr.port, False, cfg.timeout_s).get(A.MODE_KEY).decode()
    except dist.DistError:
        raise WorkerError(f"no word from the server within {cfg.timeout_s:g} s") from None
    main = async_worker_main if mode == "k-async" else worker_main
    main(worker_spec(cfg, tr.rank, tr.addr, tr.port, default_bind_host()))


def stop_workers(store, procs: list[mp.Process], current: int, grace_s: float = 10.0) -> None:
    """Tell workers to stop after ``current``, cut it short, wait (bounded), then force."""
    try:
        for t in (current, current + 1):
            if t >= 0 and not store.check([P.go_key(t)]):
                store.set(P.go_key(t), P.STOP)
        if current >= 0:
            store.set(P.cut_key(current), "1")
    except RuntimeError:
        pass  # the store is gone: workers will notice and exit on their own
    join_or_kill(procs, grace_s)


def join_or_kill(procs: list[mp.Process], grace_s: float = 10.0) -> None:
    """Wait (bounded) for the workers to exit, then terminate, then kill."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.1))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


def _with_checkpoints(server: Server, on_iteration, run_dir: Path | None):
    def callback(t: int, row: dict) -> None:
        on_iteration(t, row)
        if run_dir is not None and (t + 1) % server.cfg.record_batch == 0:
            server.flush_through(t)
            wait_written(server.writer, server.rows_added, server.cfg.timeout_s)
            save_state(run_dir, server.state(t + 1))

    return callback


def wait_written(writer: TraceWriter, rows: int, timeout_s: float) -> None:
    """Wait (bounded) until the writer has put ``rows`` rows on disk."""
    deadline = time.monotonic() + timeout_s
    while writer.rows_written < rows and time.monotonic() < deadline:
        time.sleep(0.005)


def save_state(run_dir: Path, state: dict) -> None:
    """Atomically replace the server checkpoint in the run directory."""
    save_atomic(state, run_dir / STATE_FILE)
