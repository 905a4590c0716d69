"""The admission of one synchronous iteration: tickets read in order, each handed to the policy's
:class:`IterationDriver`, until it ends the iteration; then the close. While an online policy
waits, it is asked again at the driver's ticks, in the driver's time (the workers' run-times).

A worker whose gradient is ready takes a ticket from the iteration's atomic counter
(``store.add``) and writes its :class:`WorkerReport` under it. Tickets up to the announced limit
are admitted (c for a fixed-c policy; the live count for an online one). Closing adds CLOSED to
the counter (later tickets exceed any limit), sets the cut key and admits whoever took a ticket
meanwhile.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.base import HUNG
from bdsgd.stages.engine.worker_report import WorkerReport

if TYPE_CHECKING:
    from bdsgd.stages.engine.sync import SyncEngine

CLOSE_GRACE_S = 5.0  # how long a closing engine waits for a ticket holder to name itself
HOLE_GRACE_S = 0.5  # how long a taken ticket may stay nameless before a dead holder is assumed
REPORT_GRACE_S = 0.01  # at a tick, how long a taken ticket's report is awaited before asking


class TicketAdmission:
    """A sync engine's reading of its iterations' tickets; the engine is asked for liveness
    (``live``, ``poll``, ``declare_dead``), told each admitted ticket (``admitted``), and its
    progress says whether the iteration was aborted."""

    def __init__(self, engine: SyncEngine):
        self.engine, self.c10d, self.driver = engine, engine.c10d, engine.driver
        self.holes = 0  # tickets of the iteration under way skipped: their holders died unnamed
        self.tickets = 0  # tickets of the iteration under way that may hold a report
        self.arrival_read = 0.0  # when the last arrival was handed to the driver
        self.peeked: tuple[str, WorkerReport] | None = None  # a report read before its turn

    def admit(self, t: int) -> list[WorkerReport]:
        """Read tickets in order, each handed to the driver, until it ends the iteration (or
        every live worker has reported); then close. A ticket whose holder died before naming
        itself is skipped. The admitted reports, in order."""
        deadline = time.monotonic() + self.engine.cfg.timeout_s
        reports: list[WorkerReport] = []
        ticket, self.holes, self.tickets = 1, 0, 0
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
        return reports

    def take(self, t: int, ticket: int, reports: list[WorkerReport]) -> WorkerReport:
        key = P.arrival_key(t, ticket)
        peeked, self.peeked = self.peeked, None
        report = peeked[1] if peeked and peeked[0] == key else self.read_report(key)
        reports.append(report)
        self.engine.admitted(ticket, report)
        return report

    def close(self, t: int, reports: list[WorkerReport], ticket: int) -> None:
        """No ticket is handed out any more; whoever took an admitted one (``ticket`` on)
        meanwhile is admitted too. Their reports appear right after their tickets; one that does
        not within a short grace died in between, and is left to the liveness checks."""
        total, _ = P.close_tickets(self.c10d, t)  # (the engines announce no c: the first)
        self.c10d.set(P.cut_key(t), repr(time.time()))
        limit = self.ticket_limit()
        self.tickets = min(total, limit)
        grace = time.monotonic() + min(self.engine.cfg.timeout_s, CLOSE_GRACE_S)
        for k in range(ticket, self.tickets + 1):
            if len(reports) >= limit:
                return
            if P.wait_key_until(self.c10d, P.arrival_key(t, k), grace):
                report = self.take(t, k, reports)
                self.driver.arrive(report.worker, report.runtime_s, revise=False)  # (after the cut)

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
            self.engine.poll()
            if self.engine.progress.aborted or self.all_reported():
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

    def read_report(self, key: str) -> WorkerReport:
        return WorkerReport.decode(self.c10d.get(key))

    def ticket_limit(self) -> int:
        """The last admitted ticket: c, or for an online iteration the live count announced."""
        online = self.engine.policy.online
        return self.driver.chosen if not online else int(self.driver.live.sum())

    def all_reported(self) -> bool:
        return not (self.engine.live & ~self.driver.arrived).any()

    def holder_died(self, missing_since: float) -> bool:
        """A taken ticket without a report, for longer than a report takes to write, while more
        workers of this iteration died unreported than holes were skipped: its holder is dead."""
        sent, live = self.engine.progress.sent, self.engine.live
        dead = int((sent & ~live & ~self.driver.arrived).sum())
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
        live = self.engine.live
        holders = np.zeros_like(live)
        holders[later] = True
        self.engine.declare_dead(np.flatnonzero(live & ~self.driver.arrived & ~holders), HUNG)
        return False if later else None

    # -- ticks: the driver's time -------------------------------------------------------------
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
