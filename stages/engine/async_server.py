"""The parameter server of the asynchronous mode (``k-async:K``, ``async``, ``adasync``): the same
semantics as the simulator's ``simulate_k_async``. One update reads top to bottom in
:meth:`AsyncServer.update`: ask the policy for K, take the next K gradients in arrival order
(whichever parameters they were computed on), step, tell the policy, and send fresh parameters to
those K workers only; every other worker keeps computing on the parameters it started from. A
gradient's staleness is the number of updates applied between its read and its write.

Trace rows: one per (worker, computation j), iteration = j, written when the gradient arrives
(censored False) -- the server has the facts from the gradient's header. When the run ends,
computations still under way are stopped and written censored at the time they had run;
gradients that arrived after the last update are written as the finished computations they are
(never applied). A worker that dies is written censored at the time it was declared dead.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from stages.engine import async_protocol as A
from stages.engine import protocol as P
from stages.engine.server import EngineConfig, IterationLog, scaled_lr
from stages.errors import WorkerError
from stages.policies.base import Policy
from stages.store import TraceWriter
from stages.workloads import Workload

HOLE_GRACE_S = 1.0  # a ticket taken by a worker that died before naming itself is skipped after


class AsyncServer:
    def __init__(
        self,
        cfg: EngineConfig,
        store: dist.Store,
        workload: Workload,
        policy: Policy,
        writer: TraceWriter,
        alive: Callable[[int], bool],
    ):
        self.cfg, self.store, self.policy, self.writer, self.alive = (
            cfg,
            store,
            policy,
            writer,
            alive,
        )
        self.workload, self.model = workload, workload.model
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        n = cfg.workers
        self.live = np.ones(n, dtype=bool)
        self.waiting = np.zeros(n, dtype=bool)  # gradient taken, waits for the update's params
        self.began = np.zeros(n)  # perf_counter when its current computation's params were sent
        self.began_wall = np.zeros(n)  # the same moment, wall clock (trace rows' start_s)
        self.current_j = np.zeros(n, dtype=int)  # index of its current computation
        self.next_j = np.zeros(n, dtype=int)  # index of its next computation
        self.written_j = np.zeros(n, dtype=int)  # 1 + the last computation with a trace row
        self.dead_at: dict[int, int] = {}
        self.groups: dict[int, dist.ProcessGroupGloo] = {}
        self.sends: dict[int, object] = {}  # pending parameter sends (keep their buffers alive)
        self.log = IterationLog()
        self.version = 0  # updates applied
        self.cursor = 0  # arrival tickets handled
        self.hole: tuple[int, float] | None = None  # (ticket, since) of a ticket with no holder
        self.k = 0  # K of the update under way
        self.current = -1  # the update under way (or last begun)
        self.next_iteration = 0  # the first update not completed
        self.rows_added = 0
        self.finishing = False
        self.wall_offset = 0.0
        self.t0 = self.last_end = time.perf_counter()
        self.t0_epoch = time.time()  # the trace clock's origin (the store's "t0", as the workers')
        self.grad_buf = torch.zeros(
            A.GRAD_HEADER + parameters_to_vector(self.model.parameters()).numel()
        )
        policy.overhead_s = cfg.overhead_s or 0.0

    # -- the loop -----------------------------------------------------------------------------
    def run(self, start: int, on_update: Callable[[int, dict], None]) -> None:
        self.connect()
        self.t0 = time.perf_counter() - self.wall_offset  # the clock starts with the workers
        self.last_end = time.perf_counter()
        self.version = self.next_iteration = start
        if start < self.cfg.iterations:
            self.restart(np.flatnonzero(self.live))
        for u in range(start, self.cfg.iterations):
            self.current = u
            row = self.update(u)
            self.next_iteration = u + 1
            on_update(u, row)

    def update(self, u: int) -> dict:
        self.reap()
        tic = time.perf_counter()
        self.k = min(max(int(self.policy.choose(self.live.copy())), 1), int(self.live.sum()))
        decision_ms = (time.perf_counter() - tic) * 1e3
        batch, grad_sum = self.collect(self.k)
        lr = self.step(grad_sum, len(batch))
        staleness = [self.version - h.version for h in batch]
        self.version += 1
        self.observe(batch)
        if u + 1 < self.cfg.iterations:  # after the last update the senders are told to stop
            self.restart([h.worker for h in batch if self.live[h.worker]])
        return self.record(u, batch, staleness, decision_ms, lr)

    # -- steps of an update -------------------------------------------------------------------
    def collect(self, k: int) -> tuple[list[A.GradHeader], torch.Tensor | None]:
        """The next k gradients in arrival order (fewer if workers die meanwhile)."""
        batch, grad_sum = [], None
        deadline = time.monotonic() + self.cfg.timeout_s
        while len(batch) < min(k, len(batch) + int((self.live & ~self.waiting).sum())):
            got = self.next_arrival(deadline)
            if got is None:
                continue
            header, grad = got
            batch.append(header)
            grad_sum = grad.clone() if grad_sum is None else grad_sum.add_(grad)
        return batch, grad_sum

    def next_arrival(self, deadline: float) -> tuple[A.GradHeader, torch.Tensor] | None:
        """The gradient holding the next ticket, or None when the set of workers changed (a
        death, a timeout, a ticket whose holder died) and the caller should look again."""
        ticket = self.cursor + 1
        key = A.arrival_key(ticket)
        while not P.wait_key(self.store, key, 0.05):
            if self.reap():
                return None
            if time.monotonic() > deadline:
                self.declare_dead(np.flatnonzero(self.live & ~self.waiting))
                return None
            if self.holder_died(ticket):
                self.cursor = ticket
                return None
        self.cursor = ticket
        return self.receive(int(self.store.get(key).decode()) - 1)

    def receive(self, w: int) -> tuple[A.GradHeader, torch.Tensor] | None:
        """Receive worker w's gradient and write its computation's trace row."""
        if not self.live[w]:
            return None  # declared dead (timed out): its gradient is not taken
        try:
            self.groups[w].recv([self.grad_buf], 1, A.GRAD_TAG).wait()
        except (RuntimeError, dist.DistError):
            self.declare_dead([w])
            return None
        header = A.GradHeader.unpack(self.grad_buf)
        self.waiting[w] = True
        self.add_row(w, header.j, header.start_s, header.runtime_s, False, header.delay_s)
        return header, self.grad_buf[A.GRAD_HEADER :]

    def holder_died(self, ticket: int) -> bool:
        """Whether ``ticket`` was taken by a worker that died before naming itself: only asked
        once some worker died, and only after a grace period."""
        if not self.dead_at or self.store.add(A.ARRIVALS, 0) < ticket:
            return False
        if self.hole is None or self.hole[0] != ticket:
            self.hole = (ticket, time.monotonic())
        return time.monotonic() - self.hole[1] > HOLE_GRACE_S

    def step(self, grad_sum: torch.Tensor | None, n: int) -> float:
        """Average the n gradients and step, with the learning rate scaled to n of the live."""
        lr = scaled_lr(self.cfg, n, int(self.live.sum()))
        if grad_sum is None:
            return lr
        offset = 0
        for p in self.model.parameters():
            p.grad = (grad_sum[offset : offset + p.numel()] / n).view_as(p)
            offset += p.numel()
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        return lr

    def observe(self, batch: list[A.GradHeader]) -> None:
        """As the simulator does: the senders' run-times exactly, every other worker censored at
        the time its computation has run so far (a dead one at the longest run-time applied)."""
        elapsed = np.maximum(time.perf_counter() - self.began, 1e-6)
        censored = np.ones(self.cfg.workers, dtype=bool)
        runtimes = np.where(self.live, elapsed, max((h.runtime_s for h in batch), default=1e-6))
        for h in batch:
            runtimes[h.worker], censored[h.worker] = max(h.runtime_s, 1e-6), False
        self.policy.observe(runtimes, censored)

    def restart(self, workers) -> None:
        """Send the current parameters to ``workers``: each begins its next computation."""
        vector = parameters_to_vector(self.model.parameters()).detach()
        for w in map(int, workers):
            j = int(self.next_j[w])
            payload = A.pack_params(vector, self.version, j)
            self.began[w], self.began_wall[w] = time.perf_counter(), time.time()
            self.current_j[w], self.next_j[w] = j, j + 1
            try:
                self.sends[w] = self.groups[w].send([payload], 1, A.PARAMS_TAG)
            except (RuntimeError, dist.DistError):
                self.declare_dead([w])
            self.waiting[w] = False

    def record(self, u, batch, staleness, decision_ms, lr) -> dict:
        now = time.perf_counter()
        row = dict(
            policy=self.policy.name,
            iteration=u,
            wall_s=now - self.t0,
            iteration_s=now - self.last_end,
            c=len(batch),
            workers=int(self.live.sum()),
            decision_ms=decision_ms,
            loss=float(np.mean([h.loss for h in batch])) if batch else None,
            eval_loss=self.evaluate() if u % self.cfg.eval_every == 0 else None,
            lr=lr,
            staleness=float(np.mean(staleness)) if staleness else 0.0,
            chosen_c=self.k,
            start_s=self.last_end - self.t0,
            busy_s=float(sum(h.runtime_s for h in batch)),
        )
        predicted = self.policy.describe()
        for k in ("pred_q10", "pred_q50", "pred_q90"):  # plain floats: state() saves the log
            row[k] = None if predicted.get(k) is None else float(predicted[k])
        self.log.add(**row)
        self.last_end = now
        return row

    @torch.no_grad()
    def evaluate(self) -> float:
        x, y = self.workload.eval_batch
        return float(self.workload.loss(self.model(x), y))

    # -- start, liveness, end -----------------------------------------------------------------
    def connect(self) -> None:
        """Wait (bounded) for every live worker, then build each one's pair group."""
        self.t0_epoch = float(self.store.get("t0").decode())
        deadline = time.monotonic() + self.cfg.timeout_s
        while self.store.add(A.READY, 0) < int(self.live.sum()):
            if time.monotonic() > deadline:
                raise WorkerError(f"workers did not start within {self.cfg.timeout_s:g} s")
            self.reap()
            time.sleep(0.01)
        self.store.set(A.CONNECT, ",".join(str(w) for w in np.flatnonzero(self.live)))
        for w in map(int, np.flatnonzero(self.live)):
            try:
                self.groups[w] = A.pair_group(self.store, w, 0, self.cfg.host, self.cfg.timeout_s)
            except (RuntimeError, dist.DistError):
                self.declare_dead([w])

    def reap(self) -> bool:
        """Mark workers whose process ended as dead; True if any newly died."""
        newly = [int(w) for w in np.flatnonzero(self.live) if not self.alive(int(w))]
        if newly:
            self.declare_dead(newly)
        return bool(newly)

    def declare_dead(self, workers) -> None:
        """Exclude ``workers``; a computation under way is written censored at its time so far."""
        for w in map(int, workers):
            if not self.live[w]:
                continue
            self.live[w] = False
            self.dead_at.setdefault(w, max(self.current, 0))
            if not self.waiting[w] and w in self.groups:
                self.add_censored(w)
        if self.live.sum() < self.cfg.min_workers and not self.finishing:
            raise WorkerError(
                f"only {int(self.live.sum())} worker(s) left, fewer than --min-workers "
                f"{self.cfg.min_workers}"
            )

    def finish(self, grace_s: float = 10.0) -> None:
        """End the run: stop every worker, take the gradients that still arrive (written, not
        applied), write unfinished computations censored. Bounded by ``grace_s``; never raises
        for a store or worker that is already gone."""
        self.finishing = True
        try:
            self.store.set(A.STOP, "1")
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
            if P.wait_key(self.store, A.arrival_key(self.cursor + 1), 0.02):
                self.cursor += 1
                w = int(self.store.get(A.arrival_key(self.cursor)).decode()) - 1
                if w in out and self.receive(w) is not None:
                    self.send_stop(w)
            for w in list(out):
                if self.waiting[w] or not self.live[w]:
                    out.discard(w)
                elif self.store.check([A.end_key(w)]):
                    end = A.decode_end(self.store.get(A.end_key(w)))
                    if end is not None:
                        self.add_row(w, end[0], end[1], end[2], True, end[3])
                    self.waiting[w] = True  # accounted for
                    out.discard(w)

    def send_stop(self, w: int) -> None:
        payload = torch.zeros(A.PARAM_HEADER + self.grad_buf.numel() - A.GRAD_HEADER)
        payload[0] = A.STOP_VERSION
        try:
            self.sends[w] = self.groups[w].send([payload], 1, A.PARAMS_TAG)
        except (RuntimeError, dist.DistError):
            pass

    # -- trace rows ---------------------------------------------------------------------------
    def add_censored(self, w: int) -> None:
        """Worker w's current computation, censored at the time it has run so far."""
        elapsed = time.perf_counter() - self.began[w]
        start = self.began_wall[w] - self.t0_epoch
        self.add_row(w, int(self.current_j[w]), start, elapsed, True, 0.0)

    def add_row(self, w: int, j: int, start_s, runtime_s, censored: bool, delay_s) -> None:
        values = dict(
            run_id=self.cfg.run_id,
            iteration=j,
            worker=w,
            host=self.cfg.hosts[w],
            world_size=self.cfg.workers,
            start_s=max(float(start_s), 0.0),
            runtime_s=max(float(runtime_s), 1e-6),
            censored=censored,
            cutoff=self.k or None,
            policy=self.policy.name,
            source=self.cfg.source,
            injected_delay_s=float(delay_s),
            workload=self.cfg.workload,
            batch_size=self.cfg.batch_size,
            device="cpu",
        )
        self.writer.add({k: [v] for k, v in values.items()})
        self.rows_added += 1
        self.written_j[w] = max(self.written_j[w], j + 1)

    def flush_through(self, u: int) -> None:
        """Checkpoint support: every row of the updates up to u is already with the writer."""
        self.writer.flush()

    # -- state for --resume -------------------------------------------------------------------
    def state(self, next_iteration: int) -> dict:
        """Everything needed to continue: tensors and plain values only (weights_only loads)."""
        return {
            "version": 1,
            "mode": "k-async",
            "run_id": self.cfg.run_id,
            "next_iteration": next_iteration,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "live": self.live.tolist(),
            "dead_at": {str(k): v for k, v in self.dead_at.items()},
            "log": self.log.rows,
            "next_j": [int(j) for j in self.written_j],
            "overhead": 0.0,
        }

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.live = np.array(state["live"], dtype=bool)
        self.dead_at = {int(k): v for k, v in state["dead_at"].items()}
        self.log.rows = {k: list(v) for k, v in state["log"].items()}
        self.next_j = np.array(state["next_j"], dtype=int)
        self.written_j = self.next_j.copy()
        if self.log.rows.get("wall_s"):
            self.wall_offset = self.log.rows["wall_s"][-1]  # wall-clock continues where it stopped
