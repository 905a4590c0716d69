"""The parameter server's run loop, liveness (who is alive, who died when), the per-update
metrics row, trace rows built from worker reports, and the checkpoint state that ``--resume``
continues from. :class:`bdsgd.stages.engine.async_server.AsyncServer` implements
:meth:`Engine.step` (one update).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from bdsgd.stages.console import console
from bdsgd.stages.engine.config import EngineConfig, sgd
from bdsgd.stages.errors import WorkerError
from bdsgd.stages.policies.base import Policy
from bdsgd.stages.signals import current_hold, hold_interrupts
from bdsgd.stages.store import TraceWriter
from bdsgd.stages.wire import keys as P
from bdsgd.stages.wire.janitor import KeyJanitor
from bdsgd.stages.wire.report import WorkerReport, trace_columns
from bdsgd.stages.workloads import Workload

STATE_VERSION = 3  # the iteration log's older rows in segments (resume.py)
PREDICTED = ("pred_q10", "pred_q50", "pred_q90")


NOTICE_AFTER_S = 1.0  # a Ctrl-C held this long is acknowledged on the console
HELD_NOTICE = (
    "Ctrl-C: stopping once the iteration under way is recorded whole; a slow or hung worker "
    "can hold this for about --timeout"
)


@functools.cache
def watch_held() -> None:
    """Start (once per process) the thread that prints :data:`HELD_NOTICE` when a Ctrl-C has
    been held (:func:`bdsgd.stages.signals.hold_interrupts`) for ``NOTICE_AFTER_S``, so the user
    knows it was heard while a block waits for a slow worker: it looks four times a second, and
    once per block's Ctrl-C."""

    def watch() -> None:
        noticed = None
        while True:
            time.sleep(0.25)
            hold = current_hold()
            since = None if hold is None else hold.since
            if since is not None and since != noticed and time.monotonic() - since > NOTICE_AFTER_S:
                noticed = since
                console.print(f"[yellow]{HELD_NOTICE}[/]")

    threading.Thread(target=watch, daemon=True, name="bdsgd-ctrl-c-notice").start()


@dataclass
class IterationLog:
    """What the engine keeps per iteration (metrics for the run dir), column-wise."""

    rows: dict[str, list] = field(default_factory=dict)

    def add(self, **values) -> None:
        for k, v in values.items():
            self.rows.setdefault(k, []).append(v)


EXITED = "ended (a worker's own error is on its line above: bdsgd worker <k>: ...)"
HUNG = (
    "sent nothing within --timeout (an injected delay or a computation longer than --timeout, "
    "or a worker that hung)"
)


class StopRun(Exception):
    """Raised by a run's ``on_iteration`` callback to end the run after that iteration (a
    wall-clock budget spent, a target loss reached): the engine stops as it does at the last
    of ``cfg.iterations``."""


class Engine(abc.ABC):
    """The loop and the bookkeeping; ``kind`` names the server in checkpoints."""

    kind: str = "engine"

    def __init__(
        self,
        cfg: EngineConfig,
        c10d: dist.Store,
        policy: Policy,
        writer: TraceWriter,
        alive: Callable[[int], bool],
    ):
        self.cfg, self.c10d, self.policy, self.writer, self.alive = (
            cfg,
            c10d,
            policy,
            writer,
            alive,
        )
        self.live = np.ones(cfg.workers, dtype=bool)
        self.dead_at: dict[int, int] = {}
        self.log = IterationLog()
        self.current = -1  # the iteration under way (or last begun)
        self.next_iteration = 0  # the first iteration not completed
        self.rows_added = 0  # trace rows handed to the writer
        self.overhead = 0.0  # measured fixed cost of an iteration, smoothed
        self.wall_offset = 0.0  # wall-clock already spent by the run this one resumes
        self.t0 = time.perf_counter()
        self.janitor = KeyJanitor(c10d)  # deletes the control store's keys of iterations long past
        self.recorded_at = time.monotonic()  # when the rows and checkpoint were last written
        watch_held()  # (a Ctrl-C held by the run's blocks is acknowledged on the console)

    # -- the loop -----------------------------------------------------------------------------
    def run(self, start: int, on_iteration: Callable[[int, dict], None]) -> None:
        self.next_iteration = start
        self.connect()
        self.t0 = time.perf_counter() - self.wall_offset  # the clock starts with the workers
        self.iterate(range(start, self.cfg.iterations), on_iteration)

    def iterate(self, iterations: range, on_iteration: Callable[[int, dict], None]) -> None:
        for t in iterations:
            self.current = t
            with self.one_iteration():
                row = self.step(t)
                self.next_iteration = t + 1
            try:
                on_iteration(t, row)
            except StopRun:
                return

    stopping = False  # after a stop: only what was begun is run (:meth:`run_announced`)

    def one_iteration(self) -> contextlib.AbstractContextManager:
        """What an iteration runs in: Ctrl-C ends a run between iterations. The server applies
        an update before it records it, so an update ended between the two would be in the
        parameters (and the checkpoint) but not in the log, and a resumed run would apply it
        again; the waits inside are bounded. After a stop, Ctrl-C acts at once."""
        return contextlib.nullcontext() if self.stopping else hold_interrupts()

    def run_announced(self, on_iteration: Callable[[int, dict], None]) -> None:  # noqa: B027
        """After a stop (Ctrl-C, a stop rule): run what the workers run anyway before they see
        the stop (nothing by default)."""

    @abc.abstractmethod
    def step(self, t: int) -> dict:
        """Run iteration (update) t; returns its metrics row (:meth:`record`)."""

    def connect(self) -> None:
        """Wait (bounded) until every live worker has started, so that process start-up is not
        counted as iteration 0's time (nor as the engine's overhead)."""
        self.wait_ready()

    @abc.abstractmethod
    def finish(self, current: int) -> None:
        """End the run after ``current``: stop every worker (bounded; never raises for a store
        or a worker that is already gone) and write what they still report."""

    def evaluate(self) -> float | None:
        """The held-out loss of the current parameters (None where this process holds none)."""
        return None

    def final_loss(self) -> float | None:
        """The held-out loss at the end of the run."""
        return self.evaluate()

    def extras(self) -> dict:
        """What the run's summary says of the server (a subclass adds its own)."""
        return {"engine": self.kind}

    # -- liveness -----------------------------------------------------------------------------
    def wait_ready(self) -> None:
        """Wait until every live worker has started and reached the store; past the deadline,
        or when a worker's process ends first, say which did not start."""
        workers = [int(w) for w in np.flatnonzero(self.live)]
        keys = [P.ready_key(w) for w in workers]
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while not self.c10d.check(keys):
            exited = [w for w in workers if not self.alive(w)]
            if exited or time.monotonic() > deadline:
                raise WorkerError(self.not_started(workers, exited))
            time.sleep(0.01)

    def not_started(self, workers: list[int], exited: list[int]) -> str:
        """The one-line error naming the workers that did not start."""
        if exited:
            return f"worker(s) {', '.join(map(str, exited))} exited during start-up"
        missing = [w for w in workers if not self.c10d.check([P.ready_key(w)])]
        return (f"worker(s) {', '.join(map(str, missing))} did not start within "
                f"{self.cfg.start_timeout_s:g} s (--start-timeout)")  # fmt: skip

    def reap(self) -> bool:
        """Mark workers whose process ended as dead; True if any newly died."""
        newly = [int(w) for w in np.flatnonzero(self.live) if not self.alive(int(w))]
        if newly:
            self.declare_dead(newly, EXITED)
        return bool(newly)

    def declare_dead(self, workers, cause: str = "") -> None:
        """Exclude ``workers`` from now on; fewer than ``--min-workers`` left ends the run, with
        ``cause`` (why they are dead) in the message."""
        newly = [int(w) for w in workers if self.live[int(w)]]
        for w in newly:
            self.live[w] = False
            self.dead_at.setdefault(w, max(self.current, 0))
        if newly:
            self.on_dead(newly)
        if self.live.sum() < self.cfg.min_workers:
            why = f": worker(s) {', '.join(map(str, newly))} {cause}" if newly and cause else ""
            raise WorkerError(
                f"only {int(self.live.sum())} worker(s) left, fewer than --min-workers "
                f"{self.cfg.min_workers}{why}"
            )

    def on_dead(self, workers: list[int]) -> None:  # noqa: B027 (a hook, empty by default)
        """Hook: what a subclass does when workers are declared dead."""

    # -- metrics ------------------------------------------------------------------------------
    def record(self, t: int, predicted: dict | None = None, **values) -> dict:
        """The metrics row of iteration t: the subclass's ``values`` plus what every update logs
        (policy, wall clock, live workers, held-out loss when due, the policy's prediction for
        t: ``predicted``, or what it describes now)."""
        row = dict(
            policy=self.policy.name,
            iteration=t,
            wall_s=time.perf_counter() - self.t0,
            workers=int(self.live.sum()),
            eval_loss=self.evaluate() if t % self.cfg.eval_every == 0 else None,
            staleness=0.0,
        )
        row.update(values)
        predicted = self.policy.describe() if predicted is None else predicted
        for k in PREDICTED:  # plain floats: state() saves the log
            row[k] = None if predicted.get(k) is None else float(predicted[k])
        row["peer"] = predicted.get("peer")  # self-checking bdsgd: the peer whose c it played
        self.log.add(**row)
        return row

    def measure_overhead(self, iteration_s: float, cut_s: float) -> None:
        """The engine's fixed cost (iteration time beyond the c-th run-time), smoothed and fed
        to the policy unless ``--overhead-s`` fixes it."""
        if cut_s > 0:
            self.overhead = 0.9 * self.overhead + 0.1 * max(iteration_s - cut_s, 0.0)
        fixed = self.cfg.overhead_s
        self.policy.overhead_s = fixed if fixed is not None else self.overhead

    # -- trace rows ---------------------------------------------------------------------------
    def add_rows(self, reports: list[WorkerReport], cutoff: int | None) -> None:
        """Hand the writer one schema-v1 row per report, built a column at a time (at a
        thousand iterations a second, a dict per row showed in the engine's CPU)."""
        if not reports:
            return
        cfg = self.cfg
        rows = trace_columns(reports, list(cfg.hosts), ["cpu"] * cfg.workers, run_id=cfg.run_id,
                             world_size=cfg.workers, cutoff=cutoff, policy=self.policy.name,
                             source=cfg.source, workload=cfg.workload,
                             batch_size=cfg.batch_size)  # fmt: skip
        self.writer.add(rows)
        self.rows_added += len(reports)

    def record_due(self, t: int) -> bool:
        """Whether the trace rows through iteration t, and the checkpoint, are written now:
        after every ``record_batch``-th iteration, at most once per ``record_s`` seconds (fast
        iterations would otherwise make a trace file and a checkpoint 40 times a second)."""
        return (t + 1) % self.cfg.record_batch == 0 and self.record_clock()

    def record_clock(self) -> bool:
        """True (and the clock restarts) once ``record_s`` seconds passed since the last time."""
        now = time.monotonic()
        if now - self.recorded_at < self.cfg.record_s:
            return False
        self.recorded_at = now
        return True

    def flush_through(self, t: int) -> None:
        """Every row of the iterations up to t is on disk once it returns; a failed write raises
        at once (a TraceError), as does a writer that takes longer than ``--timeout``."""
        self.writer.flush()
        self.writer.wait_written(self.rows_added, self.cfg.timeout_s)

    # -- state for --resume -------------------------------------------------------------------
    def state(self, next_iteration: int) -> dict:
        """Everything needed to continue: tensors and plain values only (weights_only loads)."""
        return {
            "version": STATE_VERSION,
            "engine": self.kind,
            "run_id": self.cfg.run_id,
            "next_iteration": next_iteration,
            "live": self.live.tolist(),
            "dead_at": {str(k): v for k, v in self.dead_at.items()},
            "log": self.log.rows,
            "overhead": self.overhead,
            **self.parameter_state(),
        }

    def load_state(self, state: dict) -> None:
        self.live = np.array(state["live"], dtype=bool)
        self.dead_at = {int(k): v for k, v in state["dead_at"].items()}
        self.log.rows = {k: list(v) for k, v in state["log"].items()}
        self.overhead = float(state["overhead"])
        if self.log.rows.get("wall_s"):
            self.wall_offset = self.log.rows["wall_s"][-1]  # wall-clock continues where it stopped
        self.load_parameter_state(state)

    @abc.abstractmethod
    def parameter_state(self) -> dict:
        """The model and optimizer state to save (a subclass that holds parameters)."""

    @abc.abstractmethod
    def load_parameter_state(self, state: dict) -> None:
        """Restore what :meth:`parameter_state` saved."""


class ServerModel:
    """The parameters an engine process holds (parameter server, asynchronous server): the model,
    its optimizer, one step on an averaged gradient, evaluation and state."""

    def __init__(self, workload: Workload, cfg: EngineConfig):
        self.workload, self.model = workload, workload.model
        self.opt = sgd(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum)

    def step(self, grad_sum: torch.Tensor, n: int, lr: float) -> None:
        """Average ``grad_sum`` (flat, parameter order) over n gradients and step with ``lr``."""
        grad_sum.div_(n)
        for p, g in zip(
            self.model.parameters(), P.flat_views(grad_sum, self.model.parameters()), strict=True
        ):
            p.grad = g
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()

    @torch.no_grad()
    def evaluate(self) -> float:
        x, y = self.workload.eval_batch
        return float(self.workload.loss(self.model(x), y))

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
