"""The synchronous cutoff iteration both sync variants share (parameter server and collective):
one iteration reads top to bottom in :meth:`SyncEngine.step` -- choose c, announce, admit tickets
through the policy driver, close, apply, observe, record, write trace rows.

Admission: a worker whose gradient is ready takes a ticket from the iteration's atomic counter
(``store.add``) and writes its :class:`WorkerReport` under it. Tickets up to the announced limit
are admitted (c for a fixed-c policy, whose c-th ticket holder sets the cut key itself; the live
count for an online policy, whose cut the engine decides). The engine reads tickets in order and
hands each to :class:`IterationDriver`, which says when the iteration ends; it then closes the
counter (adds CLOSED: later tickets exceed any limit), sets the cut key and admits whoever took a
ticket meanwhile.
"""

from __future__ import annotations

import abc
import time

import numpy as np
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.base import HUNG, Engine, interrupt_held, interrupts_deferred
from bdsgd.stages.engine.worker_report import WorkerReport
from bdsgd.stages.goodput import NoiseScale
from bdsgd.stages.policies.driver import IterationDriver, Outcome
from bdsgd.stages.stragglers import parse_stragglers

CLOSE_GRACE_S = 5.0  # how long a closing engine waits for a ticket holder to name itself
HOLE_GRACE_S = 0.5  # how long a taken ticket may stay nameless before a dead holder is assumed
REPORT_GRACE_S = 0.01  # at a tick, how long a taken ticket's report is awaited before asking
REAP_EVERY_S = 0.005  # between iterations, worker processes are looked at this often at most


class SyncEngine(Engine):
    """Cutoff iterations; a variant says how parameters reach the workers (:meth:`announce`),
    what happens per admitted ticket (:meth:`admitted`) and how the update is applied
    (:meth:`apply`)."""

    def __init__(self, cfg, c10d, policy, writer, alive):
        super().__init__(cfg, c10d, policy, writer, alive)
        self.driver = IterationDriver(policy, cfg.workers)
        self.aborted = False  # the iteration under way ends now, without an update
        self.announced = -1  # the last iteration announced
        self.begun = -1  # the last iteration whose c was chosen
        self.through = -1  # the last iteration the announcements under way cover
        self.admitting: int | None = None  # the iteration whose tickets are being read
        self.started, self.sent = 0.0, None  # when it began, and to whom
        self.holes = 0  # tickets of the iteration under way skipped: their holders died unnamed
        self.tickets = 0  # tickets of the iteration under way that may hold a report
        self.arrival_read = 0.0  # when the last arrival was handed to the driver
        self.peeked: tuple[str, WorkerReport] | None = None  # a report read before its turn
        self.reap_after = 0.0  # when :meth:`begin` looks for dead worker processes next
        self.noise = NoiseScale()  # the gradient noise scale, from the admitted gradients
        model = parse_stragglers(cfg.stragglers, cfg.seed, cfg.time_scale)
        self.delays = [model.column(cfg.iterations, cfg.workers, w) for w in range(cfg.workers)]

    def step(self, t: int) -> dict:
        """Iteration t (announced already at the end of t - 1, unless it is the first): admit,
        apply, tell the policy; then announce t + 1 at once, so the workers start it while the
        engine writes t's rows and metrics."""
        if self.begun != t:
            self.begin(t)
        start, sent = self.started, self.live.copy() if self.sent is None else self.sent
        reports = self.admit(t)
        out = self.driver.end()
        iteration_s, extra = self.apply(t, reports, start)
        self.measure_overhead(iteration_s, out.cut_s)
        predicted = self.policy.describe()
        if t + 1 < self.cfg.iterations and not (self.stop_pending and t + 1 > self.announced):
            self.begin(t + 1)
        trace_rows = self.trace_reports(t, out, reports, sent, start)
        losses = [r.loss for r in reports]
        applied = len(reports)  # out.c less any gradient lost with its worker (see apply)
        values = dict(
            iteration_s=iteration_s,
            c=applied,
            decision_ms=out.decision_ms,
            loss=sum(losses) / len(losses) if losses else None,
            chosen_c=out.chosen_c,
            start_s=start - self.t0,
            busy_s=float(sum(r.runtime_s for r in reports)),
            order=list(out.order),  # admitted workers in arrival order (not in the run dir)
            noise_scale=finite_or_none(self.noise.value),
            gain=float(self.noise.gain(applied)) if applied else None,
        )
        with interrupts_deferred():  # the trace and the iteration log agree after Ctrl-C
            self.add_rows(trace_rows, self.cutoff(out, sent))
            row = self.record(t, predicted, **{**values, **extra})
        self.janitor.retire(self.iteration_keys(t))
        return row

    def iteration_keys(self, t: int) -> list[str]:
        """The store keys iteration t left (deleted once it is long past)."""
        arrivals = [P.arrival_key(t, k) for k in range(1, self.tickets + 1)]
        return [P.go_key(t), P.ticket_key(t), P.cut_key(t), *arrivals]

    def begin(self, t: int) -> None:
        """Choose c for iteration t (the policy has observed every iteration before it) and
        announce it to the live workers, unless it was announced ahead."""
        self.aborted = False
        if time.monotonic() >= self.reap_after:  # (a waitpid per worker: at 1,000 it/s it shows)
            self.reap()
            self.reap_after = time.monotonic() + REAP_EVERY_S
        self.policy.set_noise_scale(self.noise.value, self.cfg.batch_size)
        c = self.driver.begin(self.live)
        self.started, self.sent = time.perf_counter(), self.live.copy()
        limit = P.ONLINE if self.policy.online else c
        self.through = t + self.ahead(t)  # the announcements made now hold through this one
        if self.through > self.announced:
            # under Ctrl-C too, the keys workers read and the count :meth:`stop_workers` puts
            # the stop after agree: else a worker waits for an iteration nobody runs
            with interrupts_deferred():
                self.before_announcing(max(self.announced + 1, t), self.through)
                self.announce_block(max(self.announced + 1, t), self.through, limit)
                self.announced = self.through
        self.begun = t

    def before_announcing(self, first: int, last: int) -> None:  # noqa: B027 (a hook)
        """Hook: iterations ``first..last`` are about to be announced."""

    @property
    def stop_pending(self) -> bool:
        """After a stop, or while a Ctrl-C is held (the run ends after the iteration under way):
        nothing more is announced."""
        return self.stopping or interrupt_held()

    def ahead(self, t: int) -> int:
        """Announce through iteration t + ahead(t) with t's c (variants whose workers need not
        wait for an outcome to learn a c that does not depend on it); none by default."""
        return 0

    # -- stops (Ctrl-C, stop rules) -----------------------------------------------------------
    def run_announced(self, on_iteration) -> None:
        """After a stop (Ctrl-C, a target or a wall-clock budget): announce nothing more and
        run and record the iterations already announced (the next one; a block of them for the
        collective engine's fixed c), which the workers run before they see the stop: their
        admitted gradients are received (a parameter-server worker sending to a closed group
        would wait out ``--timeout``), and the log, the traces and the checkpoint agree. Ctrl-C
        during it ends it at once (it runs once)."""
        if self.stopping:
            return
        self.stopping = True
        self.iterate(range(self.next_iteration, min(self.announced + 1, self.cfg.iterations)),
                     on_iteration)  # fmt: skip

    def stop_workers(self, current: int) -> None:
        """Tell the workers to stop after the last iteration announced (``current``, or the
        one after it when it was announced early) and cut that one short, and the one after it
        (a replica computes it before it reads the stop: its injected delay ends at once)."""
        last = max(current, self.announced)
        try:
            for t in (last, last + 1):
                if t >= 0 and not self.c10d.check([P.go_key(t)]):
                    self.c10d.set(P.go_key(t), P.STOP)
            for t in (max(last, 0), last + 1):
                self.c10d.set(P.cut_key(t), repr(time.time()))
        except RuntimeError:
            pass  # the store is gone: workers will notice and exit on their own

    def announce_block(self, first: int, last: int, limit: int) -> None:
        """Start iterations ``first..last`` with the same ``limit`` (one at a time by default;
        a variant may announce them at once)."""
        for k in range(first, last + 1):
            self.announce(k, limit)

    @abc.abstractmethod
    def announce(self, t: int, limit: int) -> None:
        """Start iteration t on every live worker; ``limit`` is c, or ONLINE."""

    def admitted(self, ticket: int, report: WorkerReport) -> None:
        """Hook: ticket ``ticket`` is admitted (the parameter server posts its receive)."""

    @abc.abstractmethod
    def apply(self, t: int, reports: list[WorkerReport], start: float) -> tuple[float, dict]:
        """Apply the admitted gradients; returns the iteration's duration and extra log values
        (``lr``, the learning rate applied, where this process applies it)."""

    # -- admission ----------------------------------------------------------------------------
    def admit(self, t: int) -> list[WorkerReport]:
        """Read tickets in order, each handed to the driver, until it ends the iteration (or
        every live worker has reported); then close. A ticket whose holder died before naming
        itself is skipped. The admitted reports, in order."""
        deadline = time.monotonic() + self.cfg.timeout_s
        reports: list[WorkerReport] = []
        self.admitting, ticket, self.holes, self.tickets = t, 1, 0, 0
        while (found := self.wait_arrival(t, ticket, deadline)) is not None:
            if found:
                report = self.take(t, ticket, reports)
                self.arrival_read = time.perf_counter()
                if self.driver.arrive(report.worker, report.runtime_s):
                    break
            else:
                self.holes += 1
            ticket += 1
        self.close(t, reports, ticket + 1 if found else ticket)
        self.admitting = None
        return reports

    def take(self, t: int, ticket: int, reports: list[WorkerReport]) -> WorkerReport:
        key = P.arrival_key(t, ticket)
        peeked, self.peeked = self.peeked, None
        report = peeked[1] if peeked and peeked[0] == key else self.read_report(key)
        reports.append(report)
        self.admitted(ticket, report)
        return report

    def close(self, t: int, reports: list[WorkerReport], ticket: int) -> None:
        """No ticket is handed out any more; whoever took an admitted one (``ticket`` on)
        meanwhile is admitted too. Their reports appear right after their tickets; one that does
        not within a short grace died in between, and is left to the liveness checks."""
        total = self.c10d.add(P.ticket_key(t), P.CLOSED) - P.CLOSED
        self.c10d.set(P.cut_key(t), repr(time.time()))
        limit = self.ticket_limit()
        self.tickets = min(total, limit)
        grace = time.monotonic() + min(self.cfg.timeout_s, CLOSE_GRACE_S)
        for k in range(ticket, self.tickets + 1):
            if len(reports) >= limit:
                return
            if P.wait_key_until(self.c10d, P.arrival_key(t, k), grace):
                report = self.take(t, k, reports)
                self.driver.arrive(report.worker, report.runtime_s)

    def wait_arrival(self, t: int, ticket: int, deadline: float) -> bool | None:
        """Whether ``ticket``'s report is in (True), or the ticket is a hole to skip (False: its
        holder died, or hung, between taking it and naming itself); None ends the admission:
        every live worker has reported, the policy stopped at a tick, or the deadline passed
        (then the workers without a ticket are declared dead). At a tick, a ticket already taken
        is read first (its report follows within ``REPORT_GRACE_S``) when its run-time is no
        later than the tick: the simulator, which knows every run-time, orders them so too."""
        key, missing_since = P.arrival_key(t, ticket), None
        if ticket > self.ticket_limit():
            return None  # a hole took an admitted ticket: nobody else is admitted
        while not P.wait_key(self.c10d, key, self.wait_slice()):
            self.poll()
            if self.aborted or self.all_reported():
                return None
            taken = self.c10d.add(P.ticket_key(t), 0) >= ticket
            if taken and P.wait_key(self.c10d, key, REPORT_GRACE_S) and self.before_tick(key):
                return True  # its holder finished before the tick due: the arrival comes first
            if self.driver.wait(self.tick_due()):
                return None  # asked again while waiting, the policy stops here
            missing_since = missing_since or (time.monotonic() if taken else None)
            if missing_since and self.holder_died(missing_since):
                return False
            if time.monotonic() > deadline:
                return self.declare_hung(t, ticket)
        return None if self.tick_stops_before(key) else True

    def tick_stops_before(self, key: str) -> bool:
        """Ticks due before the arrival under ``key`` (by its run-time) are asked first, each at
        its own time, as the simulator asks them: the engine's clock runs behind the workers'
        by however late it read the last arrival, so a report can be in before the engine's
        clock reaches a tick that came earlier. True when one ends the iteration (the arrival's
        holder, admitted by its ticket, is taken as the engine closes)."""
        if self.driver.next_tick is None:
            return False
        self.peeked = (key, self.read_report(key))  # (taken next: read once)
        return self.driver.wait_until(self.peeked[1].runtime_s)

    def before_tick(self, key: str) -> bool:
        """Whether the report under ``key`` arrived (by its run-time) no later than the driver's
        next tick: as the simulator orders them, that arrival is taken first; a later one comes
        after the tick is asked."""
        tick = self.driver.next_tick
        if tick is None:
            return True
        self.peeked = (key, self.read_report(key))  # (taken next, if it comes first: read once)
        return self.peeked[1].runtime_s <= tick

    def read_report(self, key: str) -> WorkerReport:
        return WorkerReport.decode(self.c10d.get(key))

    def tick_due(self) -> float:
        """The present for the driver while waiting: a tick that is due is asked at its own time,
        not at the moment the engine got to it (a slice late): the simulator asks it there, and
        bdsgd's answer depends on the present it is given."""
        now, tick = self.driver_now(), self.driver.next_tick
        return tick if tick is not None and now >= tick else now

    def driver_now(self) -> float:
        """The present in the driver's time (worker run-times): the last arrival's run-time plus
        the time since it was read."""
        return self.driver.latest + (time.perf_counter() - self.arrival_read)

    def wait_slice(self) -> float:
        """How long to wait for a ticket before looking again: 50 ms, or until the driver's
        next tick."""
        if self.driver.next_tick is None:
            return 0.05
        return min(0.05, max(self.driver.next_tick - self.driver_now(), 0.001))

    def ticket_limit(self) -> int:
        """The last admitted ticket: c, or for an online iteration the live count announced."""
        return self.driver.chosen if not self.policy.online else int(self.driver.live.sum())

    def all_reported(self) -> bool:
        return not (self.live & ~self.driver.arrived).any()

    def holder_died(self, missing_since: float) -> bool:
        """A taken ticket without a report, for longer than a report takes to write, while more
        workers of this iteration died unreported than holes were skipped: its holder is dead."""
        dead = int((self.sent & ~self.live & ~self.driver.arrived).sum())
        return dead > self.holes and time.monotonic() - missing_since > HOLE_GRACE_S

    def declare_hung(self, t: int, ticket: int) -> bool | None:
        """The deadline: the live workers that have not reported, and hold no later ticket,
        are hung and declared dead. If a later ticket holds a report, ``ticket`` was a hung
        worker's and is skipped (False); otherwise the admission ends (None)."""
        later = []
        k = ticket + 1
        while self.c10d.check([P.arrival_key(t, k)]):
            later.append(self.read_report(P.arrival_key(t, k)).worker)
            k += 1
        holders = np.zeros_like(self.live)
        holders[later] = True
        self.declare_dead(np.flatnonzero(self.live & ~self.driver.arrived & ~holders), HUNG)
        return False if later else None

    def poll(self) -> None:
        """Checked while waiting for a ticket: deaths (variants add their own checks)."""
        self.reap()

    # -- trace rows ---------------------------------------------------------------------------
    def trace_reports(self, t, out: Outcome, reports, sent, start) -> list[WorkerReport]:
        """One report per worker the iteration was started on: the admitted ones as they
        reported, every other one censored at the cut (the value the policy observed)."""
        by_worker = {r.worker: r for r in reports}
        rows = []
        for w in map(int, np.flatnonzero(sent)):
            rep = by_worker.get(w)
            if rep is None:
                column = self.delays[w]
                delay = float(column[t % len(column)])
                rep = WorkerReport(w, t, start - self.t0, 0.0, np.nan, delay)
                rep = rep.cut_at(float(out.runtimes[w]))
            rows.append(rep)
        return rows

    def cutoff(self, out: Outcome, sent: np.ndarray) -> int | None:
        """The trace's cutoff column: the c the iteration was run with (an online policy's
        revised one), or null when every gradient was awaited."""
        c = out.c if self.policy.online else out.chosen_c
        return c if c < int(sent.sum()) else None


def finite_or_none(value: float | None) -> float | None:
    """A log value: None for unknown or infinite (Parquet and JSON keep no inf meaningfully)."""
    return value if value is not None and np.isfinite(value) else None
