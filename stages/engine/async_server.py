"""The parameter server's update (``k-async:K``, ``async``, ``adasync``), through the simulator's
:class:`bdsgd.stages.policies.async_driver.AsyncDriver`. One update reads top to bottom in
:meth:`AsyncServer.step`: ask the driver for K, take the next K gradients in arrival order
(whichever parameters they were computed on), step, tell the driver (which tells the policy), and
send fresh parameters to those K workers only; every other worker keeps computing on the
parameters it started from. A gradient's staleness is the number of updates applied between its
read and its write.

Trace rows: one per (worker, computation j), iteration = j, from the worker's report under its
arrival ticket (censored False). When the run ends, computations still under way are stopped and
written censored at the time they had run; gradients that arrived after the last update are
written as the finished computations they are (never applied). A worker that dies is written
censored at the time it was declared dead.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
from bdsgd.stages.engine.base import Engine, ServerModel
from bdsgd.stages.engine.config import scaled_lr
from bdsgd.stages.policies.async_driver import AsyncDriver
from bdsgd.stages.signals import hold_interrupts
from bdsgd.stages.wire import keys as P
from bdsgd.stages.wire.report import WorkerReport
from torch.nn.utils import parameters_to_vector

HOLE_GRACE_S = 1.0  # a ticket taken by a worker that died before naming itself is skipped after


class AsyncServer(Engine):
    kind = "async"

    def __init__(self, cfg, c10d, workload, policy, writer, alive):
        super().__init__(cfg, c10d, policy, writer, alive)
        self.params = ServerModel(workload, cfg)
        n = cfg.workers
        self.driver = AsyncDriver(policy, n)  # K, staleness, what the policy observes
        self.waiting = np.zeros(n, dtype=bool)  # gradient taken, waits for the update's params
        self.began_wall = np.zeros(n)  # when its current computation's params were sent (wall)
        self.current_j = np.zeros(n, dtype=int)  # index of its current computation
        self.next_j = np.zeros(n, dtype=int)  # index of its next computation
        self.written_j = np.zeros(n, dtype=int)  # 1 + the last computation with a trace row
        self.groups: dict[int, dist.ProcessGroupGloo] = {}
        self.sends: dict[int, object] = {}  # pending parameter sends (keep their buffers alive)
        self.cursor = 0  # arrival tickets handled
        self.hole: tuple[int, float] | None = None  # (ticket, since) of a ticket with no holder
        self.finishing = False
        self.last_end = time.perf_counter()
        self.t0_epoch = time.time()  # the trace clock's origin (the store's "t0", as the workers')
        self.grad_buf = torch.zeros(parameters_to_vector(workload.model.parameters()).numel())
        policy.overhead_s = cfg.overhead_s or 0.0

    # -- the loop -----------------------------------------------------------------------------
    def step(self, u: int) -> dict:
        self.reap()
        batch, grad_sum = self.collect(self.driver.begin(self.live))
        lr = scaled_lr(self.cfg, len(batch), int(self.live.sum()))
        if batch:
            self.params.step(grad_sum, len(batch), lr)
        update = self.driver.end(time.perf_counter(), self.live)
        if u + 1 < self.cfg.iterations:  # after the last update the senders are told to stop
            self.restart([r.worker for r in batch if self.live[r.worker]])
        now = time.perf_counter()
        row = self.record(
            u,
            iteration_s=now - self.last_end,
            c=len(batch),
            decision_ms=update.decision_ms,
            loss=float(np.mean([r.loss for r in batch])) if batch else None,
            lr=lr,
            chosen_c=update.chosen_k,
            start_s=self.last_end - self.t0,
            busy_s=float(sum(r.runtime_s for r in batch)),
            staleness=float(update.staleness.mean()) if batch else 0.0,
            order=list(update.order),  # the senders in arrival order (not in the run dir)
        )
        self.last_end = now
        return row

    # -- steps of an update -------------------------------------------------------------------
    def collect(self, k: int) -> tuple[list[WorkerReport], torch.Tensor | None]:
        """The next k gradients in arrival order (fewer if workers die meanwhile)."""
        batch, grad_sum = [], None
        deadline = time.monotonic() + self.cfg.timeout_s
        while len(batch) < min(k, len(batch) + int((self.live & ~self.waiting).sum())):
            got = self.next_arrival(deadline)
            if got is None:
                continue
            report, grad = got
            batch.append(report)
            self.driver.arrive(report.worker, report.runtime_s)
            grad_sum = grad.clone() if grad_sum is None else grad_sum.add_(grad)
        return batch, grad_sum

    def next_arrival(self, deadline: float) -> tuple[WorkerReport, torch.Tensor] | None:
        """The gradient holding the next ticket, or None when the set of workers changed (a
        death, a timeout, a ticket whose holder died) and the caller should look again."""
        ticket = self.cursor + 1
        key = P.async_arrival_key(ticket)
        while not P.wait_key(self.c10d, key, 0.05):
            if self.reap():
                return None
            if time.monotonic() > deadline:
                self.declare_dead(np.flatnonzero(self.live & ~self.waiting))
                return None
            if self.holder_died(ticket):
                self.cursor = ticket
                return None
        self.cursor = ticket
        report = WorkerReport.decode(self.c10d.get(key))
        self.janitor.retire([key])
        return self.receive(report)

    def receive(self, report: WorkerReport) -> tuple[WorkerReport, torch.Tensor] | None:
        """Receive the reporting worker's gradient and write its computation's trace row."""
        w = report.worker
        if not self.live[w]:
            return None  # declared dead (timed out): its gradient is not taken
        try:
            self.groups[w].recv([self.grad_buf], 1, P.ASYNC_GRAD_TAG).wait()
        except (RuntimeError, dist.DistError):
            self.declare_dead([w])
            return None
        self.waiting[w] = True
        self.add_row(report)
        return report, self.grad_buf

    def holder_died(self, ticket: int) -> bool:
        """Whether ``ticket`` was taken by a worker that died before naming itself: only asked
        once some worker died, and only after a grace period."""
        if not self.dead_at or self.c10d.add(P.ASYNC_ARRIVALS, 0) < ticket:
            return False
        if self.hole is None or self.hole[0] != ticket:
            self.hole = (ticket, time.monotonic())
        return time.monotonic() - self.hole[1] > HOLE_GRACE_S

    @hold_interrupts()
    def restart(self, workers) -> None:
        """Send the current parameters to ``workers``: each begins its next computation. The
        sends and the record that they were made land together under Ctrl-C, so the end drains
        the computations they began."""
        vector = parameters_to_vector(self.params.model.parameters()).detach()
        for w in map(int, workers):
            j = int(self.next_j[w])
            payload = P.pack_params(vector, self.driver.version, j)
            self.driver.restart(w, time.perf_counter())
            self.began_wall[w] = time.time()
            self.current_j[w], self.next_j[w] = j, j + 1
            try:
                self.sends[w] = self.groups[w].send([payload], 1, P.ASYNC_PARAMS_TAG)
            except (RuntimeError, dist.DistError):
                self.declare_dead([w])
            self.waiting[w] = False

    def evaluate(self) -> float:
        return self.params.evaluate()

    # -- start, liveness, end -----------------------------------------------------------------
    def connect(self) -> None:
        """Wait (bounded) for every live worker, then build each one's pair group."""
        self.t0_epoch = float(self.c10d.get(P.T0_KEY).decode())
        self.wait_ready()
        self.c10d.set(P.ASYNC_CONNECT, ",".join(str(w) for w in np.flatnonzero(self.live)))
        for w in map(int, np.flatnonzero(self.live)):
            try:
                self.groups[w] = P.pair_group(self.c10d, w, 0, self.cfg.host, self.cfg.timeout_s)
            except (RuntimeError, dist.DistError):
                self.declare_dead([w])
        self.last_end = time.perf_counter()
        self.driver.version = self.next_iteration
        if self.next_iteration < self.cfg.iterations:
            self.restart(np.flatnonzero(self.live))  # everyone begins its first computation

    def declare_dead(self, workers, cause: str = "") -> None:
        if self.finishing:  # the run is over: exclude, never abort
            for w in map(int, workers):
                if self.live[w]:
                    self.live[w] = False
                    self.on_dead([w])
            return
        super().declare_dead(workers, cause)

    def on_dead(self, workers: list[int]) -> None:
        """A computation under way is written censored at its time so far."""
        for w in workers:
            if not self.waiting[w] and w in self.groups:
                self.add_censored(w)

    def finish(self, current: int, grace_s: float = 10.0) -> None:
        """End the run: stop every worker, take the gradients that still arrive (written, not
        applied), write unfinished computations censored. Bounded by ``grace_s``; never raises
        for a store or worker that is already gone."""
        self.finishing = True
        try:
            self.c10d.set(P.ASYNC_STOP, "1")
            for w in np.flatnonzero(self.live & self.waiting):
                self.send_stop(int(w))
            self.drain(time.monotonic() + grace_s)
        except (RuntimeError, dist.DistError):
            pass  # the store is gone: workers notice and exit on their own
        for w in np.flatnonzero(self.live & ~self.waiting):
            if int(w) in self.groups:
                self.add_censored(int(w))  # never reported back: censored at the time so far

    def drain(self, deadline: float) -> None:
        """Until every computing worker has delivered or reported its unfinished computation."""
        out = {int(w) for w in np.flatnonzero(self.live & ~self.waiting) if int(w) in self.groups}
        while out and time.monotonic() < deadline:
            self.reap()
            if P.wait_key(self.c10d, P.async_arrival_key(self.cursor + 1), 0.02):
                self.cursor += 1
                report = WorkerReport.decode(self.c10d.get(P.async_arrival_key(self.cursor)))
                if report.worker in out and self.receive(report) is not None:
                    self.send_stop(report.worker)
            for w in list(out):
                if self.waiting[w] or not self.live[w]:
                    out.discard(w)
                elif self.c10d.check([P.async_end_key(w)]):
                    if blob := self.c10d.get(P.async_end_key(w)):
                        self.add_row(WorkerReport.decode(blob))
                    self.waiting[w] = True  # accounted for
                    out.discard(w)

    def send_stop(self, w: int) -> None:
        payload = torch.zeros(P.PARAM_HEADER + self.grad_buf.numel())
        payload[0] = P.STOP_VERSION
        try:
            self.sends[w] = self.groups[w].send([payload], 1, P.ASYNC_PARAMS_TAG)
        except (RuntimeError, dist.DistError):
            pass

    # -- trace rows ---------------------------------------------------------------------------
    def add_censored(self, w: int) -> None:
        """Worker w's current computation, censored at the time it has run so far."""
        elapsed = time.perf_counter() - self.driver.began[w]
        start = self.began_wall[w] - self.t0_epoch
        self.add_row(
            WorkerReport(w, int(self.current_j[w]), start, elapsed, np.nan, 0.0).cut_at(elapsed)
        )

    def add_row(self, report: WorkerReport) -> None:
        self.add_rows([report], self.driver.k or None)
        self.written_j[report.worker] = max(self.written_j[report.worker], report.iteration + 1)

    # -- state for --resume -------------------------------------------------------------------
    def parameter_state(self) -> dict:
        return {**self.params.state(), "next_j": [int(j) for j in self.written_j]}

    def load_parameter_state(self, state: dict) -> None:
        self.params.load(state)
        self.next_j = np.array(state["next_j"], dtype=int)
        self.written_j = self.next_j.copy()
