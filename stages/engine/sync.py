"""The synchronous cutoff iteration both sync variants share (parameter server and collective):
one iteration reads top to bottom in :meth:`SyncEngine.step` -- choose c, announce, admit tickets
through the policy driver (:class:`TicketAdmission`), close, apply, observe, record, write trace
rows. Where the iterations stand (begun, announced, aborted, stopping) is one :class:`Progress`.
"""

from __future__ import annotations

import abc
import time

import numpy as np
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.admission import TicketAdmission
from bdsgd.stages.engine.base import Engine
from bdsgd.stages.engine.progress import Progress
from bdsgd.stages.engine.worker_report import WorkerReport
from bdsgd.stages.goodput import NoiseScale
from bdsgd.stages.policies.driver import IterationDriver, Outcome
from bdsgd.stages.signals import hold_interrupts, interrupt_held
from bdsgd.stages.stragglers import parse_stragglers

REAP_EVERY_S = 0.005  # between iterations, worker processes are looked at this often at most


class SyncEngine(Engine):
    """Cutoff iterations; a variant says how parameters reach the workers (:meth:`announce`),
    what happens per admitted ticket (:meth:`admitted`) and how the update is applied
    (:meth:`apply`)."""

    def __init__(self, cfg, c10d, policy, writer, alive):
        super().__init__(cfg, c10d, policy, writer, alive)
        self.driver = IterationDriver(policy, cfg.workers)
        self.progress = Progress()  # where the iterations stand (begun, announced, aborted, ...)
        self.admission = TicketAdmission(self)  # the tickets of the iteration under way
        self.reap_after = 0.0  # when :meth:`begin` looks for dead worker processes next
        self.noise = NoiseScale()  # the gradient noise scale, from the admitted gradients
        model = parse_stragglers(cfg.stragglers, cfg.seed, cfg.time_scale)
        self.delays = [model.column(cfg.iterations, cfg.workers, w) for w in range(cfg.workers)]

    def step(self, t: int) -> dict:
        """Iteration t (announced already at the end of t - 1, unless it is the first): admit,
        apply, tell the policy; then announce t + 1 at once, so the workers start it while the
        engine writes t's rows and metrics."""
        if self.progress.begun != t:
            self.begin(t)
        start, sent = self.progress.started, self.progress.sent
        sent = self.live.copy() if sent is None else sent
        reports = self.admit(t)
        out = self.driver.end()
        iteration_s, extra = self.apply(t, reports, start)
        self.measure_overhead(iteration_s, out.cut_s)
        predicted = self.policy.describe()
        announced = self.progress.announced
        if t + 1 < self.cfg.iterations and not (self.stop_pending and t + 1 > announced):
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
        with hold_interrupts():  # the trace and the iteration log agree after Ctrl-C
            self.add_rows(trace_rows, self.cutoff(out, sent))
            row = self.record(t, predicted, **{**values, **extra})
        self.janitor.retire(self.iteration_keys(t))
        return row

    def iteration_keys(self, t: int) -> list[str]:
        """The store keys iteration t left (deleted once it is long past)."""
        arrivals = [P.arrival_key(t, k) for k in range(1, self.admission.tickets + 1)]
        return [P.go_key(t), P.ticket_key(t), P.cut_key(t), *arrivals]

    def begin(self, t: int) -> None:
        """Choose c for iteration t (the policy has observed every iteration before it) and
        announce it to the live workers, unless it was announced ahead. An online policy's
        iteration is announced first (its limit is no c: the policy decides at the arrivals),
        so that its ``choose`` runs while the workers compute instead of before they start. A
        worker that finishes before ``choose`` returns (steps shorter than the decision, a
        millisecond or two) has its ticket read with the others taken meanwhile, as a batch:
        the revision at their last can cut there but not below them."""
        state = self.progress
        state.aborted = False
        if time.monotonic() >= self.reap_after:  # (a waitpid per worker: at 1,000 it/s it shows)
            self.reap()
            self.reap_after = time.monotonic() + REAP_EVERY_S
        self.policy.set_noise_scale(self.noise.value, self.cfg.batch_size)
        if self.policy.online:
            state.started, state.sent = time.perf_counter(), self.live.copy()
            self.announce_through(t, P.ONLINE)
            self.driver.begin(self.live)
        else:
            c = self.driver.begin(self.live)
            state.started, state.sent = time.perf_counter(), self.live.copy()
            self.announce_through(t, c)
        state.begun = t

    def announce_through(self, t: int, limit: int) -> None:
        """Announce t (and as far ahead as :meth:`ahead` says) with ``limit``, unless announced
        already."""
        state = self.progress
        state.through = t + self.ahead(t)  # the announcements made now hold through this one
        if state.through > state.announced:
            # under Ctrl-C too, the keys workers read and the count :meth:`stop_workers` puts
            # the stop after agree: else a worker waits for an iteration nobody runs
            with hold_interrupts():
                self.before_announcing(max(state.announced + 1, t), state.through)
                self.announce_block(max(state.announced + 1, t), state.through, limit)
                state.announced = state.through

    def before_announcing(self, first: int, last: int) -> None:  # noqa: B027 (a hook)
        """Hook: iterations ``first..last`` are about to be announced."""

    @property
    def stopping(self) -> bool:
        """After a stop: only what was announced is run (:meth:`run_announced`)."""
        return self.progress.stopping

    @property
    def stop_pending(self) -> bool:
        """After a stop, or while a Ctrl-C is held (the run ends after the iteration under way):
        nothing more is announced."""
        return self.progress.stopping or interrupt_held()

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
        if self.progress.stopping:
            return
        self.progress.stopping = True
        last = min(self.progress.announced + 1, self.cfg.iterations)
        self.iterate(range(self.next_iteration, last),
                     on_iteration)  # fmt: skip

    def stop_workers(self, current: int) -> None:
        """Tell the workers to stop after the last iteration announced (``current``, or the
        one after it when it was announced early) and cut that one short, and the one after it
        (a replica computes it before it reads the stop: its injected delay ends at once)."""
        last = max(current, self.progress.announced)
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

    # -- admission (:class:`TicketAdmission`) -------------------------------------------------
    def admit(self, t: int) -> list[WorkerReport]:
        """Iteration t's admitted reports, in order (:meth:`TicketAdmission.admit`)."""
        self.progress.admitting = t
        reports = self.admission.admit(t)
        self.progress.admitting = None
        return reports

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
