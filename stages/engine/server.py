"""The parameter server loop. One iteration reads top to bottom in :meth:`Server.iteration`:
choose c, send parameters, admit the c ticketed gradients, step, tell the policy."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from stages.engine import protocol as P
from stages.errors import WorkerError
from stages.policies.base import Policy
from stages.store import TraceWriter
from stages.workloads import Workload

CLOSE_GRACE_S = 5.0  # how long a closing server waits for a ticket holder to name itself


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Settings of one engine run (built by the profile and train stages)."""

    workers: int
    iterations: int
    run_id: str
    source: str  # "profile" or "train": the trace rows' source
    workload: str = "mlp"
    batch_size: int = 32
    micro_batches: int = 4
    stragglers: str = "none"
    time_scale: float = 1.0
    seed: int = 0
    lr: float = 0.05
    momentum: float = 0.9
    lr_scaling: str = "linear"  # linear | sqrt | none: lr * f(c / live workers)
    record_batch: int = 25  # iterations per trace batch (and per server checkpoint)
    eval_every: int = 10
    min_workers: int = 1
    timeout_s: float = 60.0
    host: str = "127.0.0.1"
    hosts: tuple[str, ...] = ()  # trace host of each worker (emulated hosts, or the machine)
    overhead_s: float | None = None  # None: measure it and feed it to the policy


def engine_config(stage_cfg, **values) -> EngineConfig:
    """An EngineConfig from a stage config: fields of the same name are copied, ``values`` add
    the rest (run_id, source, hosts)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    shared = {k: getattr(stage_cfg, k) for k in names if hasattr(stage_cfg, k)}
    return EngineConfig(**{**shared, **values})


def sgd(params, lr: float, momentum: float) -> torch.optim.SGD:
    """torch's SGD, fused where the parameters allow: the same arithmetic in fewer kernels."""
    params = list(params)
    try:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, fused=True)
    except RuntimeError:
        return torch.optim.SGD(params, lr=lr, momentum=momentum)


def scaled_lr(cfg: EngineConfig, n: int, live: int) -> float:
    """The learning rate for a step on n gradients of ``live`` workers (``--lr-scaling``)."""
    ratio = n / max(live, 1)
    return cfg.lr * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[cfg.lr_scaling]


@dataclass
class IterationLog:
    """What the server keeps per iteration (metrics for the run dir, facts for trace rows)."""

    rows: dict[str, list] = field(default_factory=dict)

    def add(self, **values) -> None:
        for k, v in values.items():
            self.rows.setdefault(k, []).append(v)


class Server:
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
        self.opt = sgd(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        self.live = np.ones(cfg.workers, dtype=bool)
        self.dead_at: dict[int, int] = {}
        self.generation, self.group, self.members = -1, None, [0]
        self.pending_sends: list = []
        self.log = IterationLog()
        self.sent: dict[int, np.ndarray] = {}  # iteration -> workers sent parameters
        self.next_batch = 0
        self.current = -1  # the iteration under way (or last begun)
        self.next_iteration = 0  # the first iteration not completed
        self.rows_added = 0  # trace rows handed to the writer
        self.facts: dict[int, dict] = {}
        self.overhead = 0.0
        self.wall_offset = 0.0  # wall-clock already spent by the run this one resumes
        self.t0 = time.perf_counter()
        size = parameters_to_vector(self.model.parameters()).numel()
        self.grad_bufs: list[torch.Tensor] = []  # one receive buffer per admitted gradient
        self.grad_size = P.GRAD_HEADER + size
        self.flat_grad = torch.zeros(size)  # the admitted gradients' sum, then their mean
        self.grad_views = P.flat_views(self.flat_grad, self.model.parameters())

    # -- the loop -----------------------------------------------------------------------------
    def run(self, start: int, on_iteration: Callable[[int, dict], None]) -> None:
        self.wait_ready()
        self.t0 = time.perf_counter() - self.wall_offset  # the clock starts with the workers
        self.next_iteration = start
        for t in range(start, self.cfg.iterations):
            self.current = t
            row = self.iteration(t)
            self.next_iteration = t + 1
            on_iteration(t, row)
            self.collect_records(upto=t - max(2, self.cfg.record_batch // 2))

    def iteration(self, t: int) -> dict:
        self.reap()
        tic = time.perf_counter()
        c = min(self.policy.choose(self.live.copy()), int(self.live.sum()))
        decision_ms = (time.perf_counter() - tic) * 1e3
        start = time.perf_counter()
        if self.policy.online:
            self.announce(t, P.ONLINE)
            admitted, grad_sum, revise_ms = self.admit_online(t, c)
            c, decision_ms = len(admitted), decision_ms + revise_ms
        else:
            self.announce(t, c)
            admitted, grad_sum = self.admit(t, c)
        iteration_s = time.perf_counter() - start
        lr = self.apply(grad_sum, len(admitted))
        runtimes = self.observe(admitted)
        self.measure_overhead(iteration_s, runtimes)
        return self.record(t, c, admitted, iteration_s, decision_ms, lr, start)

    # -- steps of an iteration ----------------------------------------------------------------
    def announce(self, t: int, c: int) -> None:
        """New generation if the live set changed, then parameters to every live worker."""
        members = [0, *(np.flatnonzero(self.live) + 1).tolist()]
        if members != self.members:
            self.generation += 1
            self.store.set(P.members_key(self.generation), P.encode_members(members))
        self.store.set(P.go_key(t), str(self.generation))
        if members != self.members:
            self.group = P.build_group(
                self.store, self.generation, members, 0, self.cfg.host, self.cfg.timeout_s
            )
            self.members = members
        payload = P.pack_params_of(self.model.parameters(), t, c)
        self.pending_sends = [
            self.group.send([payload], r, P.PARAMS_TAG) for r in range(1, len(members))
        ]
        self.sent[t] = self.live.copy()

    def admit(self, t: int, c: int) -> tuple[list[tuple[int, float, float]], torch.Tensor | None]:
        """Receive the gradients of tickets 1..c (or of as many as were taken once workers died
        or timed out), summed into the model's gradient."""
        recvs = self.post_receives(c)
        taken = self.wait_tickets(t, c)
        admitted, grad_sum = self.receive(recvs[:taken])
        if taken < c:
            self.grad_bufs = []  # receives left posted in this group may still land: new buffers
            self.store.set(P.cut_key(t), "1")  # close the iteration for whoever is still out
        return admitted, grad_sum

    def admit_online(self, t: int, c: int) -> tuple[list, torch.Tensor | None, float]:
        """Admit gradients as they arrive, asking the policy at each arrival whether to wait for
        more (:meth:`Policy.revise`), then close the iteration. A receive is posted for each
        ticket as it is read, so admitted gradients land while the server decides. Returns the
        admitted gradients, their sum and the milliseconds of the revise call that ended it."""
        deadline = time.monotonic() + self.cfg.timeout_s
        runtimes = np.zeros(self.cfg.workers)
        arrived = np.zeros(self.cfg.workers, dtype=bool)
        recvs: list[tuple[dist.Work, torch.Tensor]] = []
        target, revise_ms = c, 0.0
        while len(recvs) < int(self.live.sum()) and self.wait_arrival(t, len(recvs) + 1, deadline):
            self.read_arrival(t, len(recvs) + 1, runtimes, arrived)
            recvs.append(self.post_receive(len(recvs)))
            if len(recvs) < int(self.live.sum()):
                tic = time.perf_counter()
                # the present: the longest run-time in so far (tickets come in wall-clock order,
                # run-times count from each worker's own receipt of the parameters)
                now = float(runtimes[arrived].max())
                target = self.policy.revise(now, runtimes, arrived & self.live)
                revise_ms = (time.perf_counter() - tic) * 1e3
            if len(recvs) >= target:
                break
        self.close(t, recvs, runtimes, arrived)
        admitted, grad_sum = self.receive(recvs)
        return admitted, grad_sum, revise_ms

    def read_arrival(self, t: int, ticket: int, runtimes: np.ndarray, arrived: np.ndarray):
        """Record who holds ``ticket`` and its run-time."""
        proc, runtime = P.decode_arrival(self.store.get(P.arrival_key(t, ticket)))
        runtimes[proc - 1], arrived[proc - 1] = max(runtime, 1e-9), True

    def close(self, t: int, recvs: list, runtimes: np.ndarray, arrived: np.ndarray) -> None:
        """Close iteration t: no ticket is handed out any more, and whoever took one meanwhile is
        admitted too (a receive for each, so no sender is left without one). Their names appear
        right after their tickets; one that does not within a short grace died in between, and
        is left to the liveness checks."""
        total = self.store.add(P.ticket_key(t), P.CLOSED) - P.CLOSED
        self.store.set(P.cut_key(t), "1")
        grace = time.monotonic() + min(self.cfg.timeout_s, CLOSE_GRACE_S)
        while len(recvs) < min(total, len(self.members) - 1):
            if not P.wait_key_until(self.store, P.arrival_key(t, len(recvs) + 1), grace):
                return
            self.read_arrival(t, len(recvs) + 1, runtimes, arrived)
            recvs.append(self.post_receive(len(recvs)))

    def receive(self, recvs: list[tuple[dist.Work, torch.Tensor]]):
        """Wait for the posted receives; the admitted gradients, summed into the model's
        gradient, and their (worker, run-time, loss)."""
        admitted = []
        for work, buf in recvs:
            work.wait()
            admitted.append(self.add_gradient(buf, first=not admitted))
        return admitted, (self.flat_grad if admitted else None)

    def add_gradient(self, buf: torch.Tensor, first: bool) -> tuple[int, float, float]:
        """Add one received gradient payload into the sum; returns (worker, run-time, loss)."""
        runtime, loss, worker = buf[: P.GRAD_HEADER].tolist()
        if first:
            self.flat_grad.copy_(buf[P.GRAD_HEADER :])
        else:
            self.flat_grad.add_(buf[P.GRAD_HEADER :])
        return int(worker), runtime, loss

    def post_receives(self, c: int) -> list[tuple[dist.Work, torch.Tensor]]:
        """c any-source receives, posted before the gradients are sent: a gloo send waits for
        its receive, so admitted workers' sends complete as they arrive, in any order (each
        payload names its worker)."""
        return [self.post_receive(i) for i in range(c)]

    def post_receive(self, i: int) -> tuple[dist.Work, torch.Tensor]:
        """An any-source gradient receive into the i-th receive buffer."""
        while len(self.grad_bufs) <= i:
            self.grad_bufs.append(torch.zeros(self.grad_size))
        buf = self.grad_bufs[i]
        return self.group.recv_anysource([buf], P.GRAD_TAG), buf

    def wait_tickets(self, t: int, c: int) -> int:
        """How many of tickets 1..c were taken: all c, in one store wait while every worker is
        alive; after a death or a timeout, ticket by ticket."""
        deadline = time.monotonic() + self.cfg.timeout_s
        keys = [P.arrival_key(t, ticket) for ticket in range(1, c + 1)]
        while not P.wait_keys(self.store, keys, 0.05):
            if self.reap() or time.monotonic() > deadline:
                return self.count_tickets(t, c, deadline)
        return c

    def count_tickets(self, t: int, c: int, deadline: float) -> int:
        """Tickets taken in order until one cannot come (see :meth:`wait_arrival`)."""
        taken = 0
        while taken < c and self.wait_arrival(t, taken + 1, deadline):
            taken += 1
        return taken

    def wait_arrival(self, t: int, ticket: int, deadline: float) -> bool:
        """Whether ``ticket`` is taken; False once fewer live workers remain than tickets, or
        at the deadline (then the workers without a ticket are declared dead)."""
        key = P.arrival_key(t, ticket)
        while not P.wait_key(self.store, key, 0.05):
            self.reap()
            if ticket > int(self.live.sum()):
                return False
            if time.monotonic() > deadline:
                self.declare_dead(self.unfinished(t), t)
                return False
        return True

    def apply(self, grad_sum: torch.Tensor | None, n: int) -> float:
        """Average the admitted gradients and step, with the learning rate scaled to n."""
        lr = scaled_lr(self.cfg, n, int(self.live.sum()))
        if grad_sum is None:
            return lr
        torch.div(grad_sum, n, out=self.flat_grad)
        for p, g in zip(self.model.parameters(), self.grad_views, strict=True):
            p.grad = g
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        return lr

    def observe(self, admitted: list[tuple[int, float, float]]) -> np.ndarray:
        """Tell the policy what the server saw: admitted run-times exactly, everyone else
        censored at the moment of the cut (the last admitted run-time)."""
        cut = max((rt for _, rt, _ in admitted), default=0.0)
        runtimes = np.full(self.cfg.workers, max(cut, 1e-6))
        censored = np.ones(self.cfg.workers, dtype=bool)
        for w, rt, _ in admitted:
            runtimes[w], censored[w] = max(rt, 1e-6), False
        self.policy.observe(runtimes, censored)
        return runtimes[~censored]

    def measure_overhead(self, iteration_s: float, runtimes: np.ndarray) -> None:
        """The engine's fixed cost: iteration time beyond the c-th run-time, smoothed."""
        if runtimes.size:
            beyond = max(iteration_s - float(runtimes.max()), 0.0)
            self.overhead = 0.9 * self.overhead + 0.1 * beyond  # a plain float: state() saves it
        self.policy.overhead_s = (
            self.cfg.overhead_s if self.cfg.overhead_s is not None else self.overhead
        )

    def record(self, t, c, admitted, iteration_s, decision_ms, lr, start) -> dict:
        losses = [loss for _, _, loss in admitted]
        row = dict(
            policy=self.policy.name,
            iteration=t,
            wall_s=time.perf_counter() - self.t0,
            iteration_s=iteration_s,
            c=len(admitted),
            workers=int(self.live.sum()),
            decision_ms=decision_ms,
            loss=float(np.mean(losses)) if losses else None,
            eval_loss=self.evaluate() if t % self.cfg.eval_every == 0 else None,
            lr=lr,
            staleness=0.0,
            chosen_c=c,
            start_s=start - self.t0,
            busy_s=float(sum(rt for _, rt, _ in admitted)),
        )
        predicted = self.policy.describe()
        for k in ("pred_q10", "pred_q50", "pred_q90"):  # plain floats: state() saves the log
            row[k] = None if predicted.get(k) is None else float(predicted[k])
        self.log.add(**row)
        self.facts[t] = row
        return row

    @torch.no_grad()
    def evaluate(self) -> float:
        x, y = self.workload.eval_batch
        return float(self.workload.loss(self.model(x), y))

    # -- liveness -----------------------------------------------------------------------------
    def wait_ready(self) -> None:
        """Wait (bounded) until every live worker has started, so that process start-up is not
        counted as iteration 0's time (nor as the engine's overhead)."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while self.store.add(P.READY, 0) < int(self.live.sum()):
            if time.monotonic() > deadline:
                raise WorkerError(f"workers did not start within {self.cfg.timeout_s:g} s")
            self.reap()
            time.sleep(0.01)

    def reap(self) -> bool:
        """Mark workers whose process ended as dead; True if any newly died."""
        newly = [w for w in np.flatnonzero(self.live) if not self.alive(int(w))]
        if newly:
            self.declare_dead(newly, len(self.log.rows.get("iteration", [])))
        return bool(newly)

    def declare_dead(self, workers, t: int) -> None:
        for w in workers:
            self.live[int(w)] = False
            self.dead_at.setdefault(int(w), t)
        if self.live.sum() < self.cfg.min_workers:
            raise WorkerError(
                f"only {int(self.live.sum())} worker(s) left, fewer than --min-workers {self.cfg.min_workers}"
            )

    def unfinished(self, t: int) -> list[int]:
        """Live workers that have not taken a ticket in iteration t (blamed on a timeout)."""
        arrived = set()
        ticket = 1
        while self.store.check([P.arrival_key(t, ticket)]):
            arrived.add(P.decode_arrival(self.store.get(P.arrival_key(t, ticket)))[0] - 1)
            ticket += 1
        return [int(w) for w in np.flatnonzero(self.live) if int(w) not in arrived]

    # -- trace rows ---------------------------------------------------------------------------
    def collect_records(self, upto: int, final: bool = False) -> None:
        """Append trace rows of every record batch whose iterations all ended by ``upto``
        (``final``: also the last, partial batch)."""
        b = self.cfg.record_batch
        last = upto // b if final else (upto + 1) // b - 1
        while self.next_batch <= last:
            if rows := self.batch_rows(self.next_batch):
                self.writer.add(rows)
                self.rows_added += len(rows["run_id"])
            self.next_batch += 1

    def flush_through(self, t: int) -> None:
        """Hand the writer the rows of every iteration up to t, waiting (bounded) for the
        workers' records of t: a checkpoint must never claim iterations whose rows only lived in
        the store (they would be lost with it)."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while not self.records_complete(t) and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.005)
        self.collect_records(upto=t, final=True)
        self.writer.flush()

    def records_complete(self, t: int) -> bool:
        """Whether every live worker that was sent iteration t has recorded it."""
        sent = self.sent.get(t)
        if sent is None:
            return True
        batch = t // self.cfg.record_batch
        for w in np.flatnonzero(sent & self.live):
            key = P.record_key(int(w), batch)
            if not self.store.check([key]) or not P.Record.covers(self.store.get(key), t):
                return False
        return True

    def batch_rows(self, batch: int) -> dict[str, list]:
        """Rows of one record batch. A worker that was sent an iteration but never reported it
        (it died) is censored at the moment the iteration ended."""
        b = self.cfg.record_batch
        records = self.read_records(batch)
        rows: dict[str, list] = {}
        for t in range(batch * b, (batch + 1) * b):
            if t not in self.sent or t not in self.facts:
                self.sent.pop(t, None)  # not begun, or cut short by Ctrl-C: no rows
                continue
            facts = self.facts.pop(t)
            sent = self.sent.pop(t)
            cutoff = facts["chosen_c"] if facts["chosen_c"] < int(sent.sum()) else None
            for w in np.flatnonzero(sent):
                rec = records.get((t, int(w))) or P.Record(
                    t, facts["start_s"], facts["iteration_s"], True, 0.0
                )
                self._row(rows, rec, int(w), cutoff)
        return rows

    def read_records(self, batch: int) -> dict[tuple[int, int], P.Record]:
        out = {}
        for w in range(self.cfg.workers):
            key = P.record_key(w, batch)
            if self.store.check([key]):
                for rec in P.Record.decode_all(self.store.get(key)):
                    out[(rec.iteration, w)] = rec
                self.store.delete_key(key)
        return out

    def _row(self, rows: dict[str, list], rec: P.Record, w: int, cutoff: int | None) -> None:
        values = dict(
            run_id=self.cfg.run_id,
            iteration=rec.iteration,
            worker=w,
            host=self.cfg.hosts[w],
            world_size=self.cfg.workers,
            start_s=max(rec.start_s, 0.0),
            runtime_s=max(rec.runtime_s, 1e-6),
            censored=rec.censored,
            cutoff=cutoff,
            policy=self.policy.name,
            source=self.cfg.source,
            injected_delay_s=rec.delay_s,
            workload=self.cfg.workload,
            batch_size=self.cfg.batch_size,
            device="cpu",
        )
        for k, v in values.items():
            rows.setdefault(k, []).append(v)

    # -- state for --resume -------------------------------------------------------------------
    def state(self, next_iteration: int) -> dict:
        """Everything needed to continue: tensors and plain values only (weights_only loads)."""
        return {
            "version": 1,
            "run_id": self.cfg.run_id,
            "next_iteration": next_iteration,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "live": self.live.tolist(),
            "dead_at": {str(k): v for k, v in self.dead_at.items()},
            "log": self.log.rows,
            "overhead": self.overhead,
        }

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.live = np.array(state["live"], dtype=bool)
        self.dead_at = {int(k): v for k, v in state["dead_at"].items()}
        self.log.rows = {k: list(v) for k, v in state["log"].items()}
        self.overhead = float(state["overhead"])
        if self.log.rows.get("wall_s"):
            self.wall_offset = self.log.rows["wall_s"][-1]  # wall-clock continues where it stopped
