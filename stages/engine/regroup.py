"""The collective coordinator's failures: which members reported a failed all-reduce
(``cfail/<generation>``), which are hung, and the new generation of the survivors, resuming where
no update is applied twice, nor applied without being logged.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.base import HUNG
from bdsgd.stages.signals import hold_interrupts

if TYPE_CHECKING:
    from bdsgd.stages.engine.collective import Coordinator

FAIL_GRACE_S = 5.0  # after a failure report, how long the other members have to report too


class Regrouping:
    """A coordinator's failure handling; it moves the coordinator's :class:`Progress` and
    announces through its :class:`Announcer`."""

    def __init__(self, engine: Coordinator):
        self.engine, self.c10d = engine, engine.c10d

    def failure_reported(self) -> bool:
        """Whether a member of the current generation reported a failed all-reduce."""
        return self.c10d.check([P.fail_key(self.engine.announcer.generation)])

    @hold_interrupts()
    def handle_failure(self) -> None:
        """A member's all-reduce failed: every member that is alive reports it within a grace;
        the ones that do not are hung, and declared dead. Ctrl-C waits for the regrouping: the
        members that reported wait for the next generation, not for the stop."""
        engine = self.engine
        # found by a member's report: the others' all-reduce fails too, within a grace; found
        # by the coordinator's deadline, no report yet: a loaded machine may be slow to fail
        # every member's all-reduce (--timeout / 2), so they have a whole --timeout to report
        grace_s = FAIL_GRACE_S if self.failure_reported() else engine.cfg.timeout_s
        grace = time.monotonic() + min(engine.cfg.timeout_s, grace_s)
        members = set(np.flatnonzero(engine.live).tolist())
        while time.monotonic() < grace:
            engine.reap()
            reported = self.failed_members() | set(np.flatnonzero(~engine.live).tolist())
            if members <= reported:
                break
            time.sleep(0.05)
        hung = members - self.failed_members()
        engine.declare_dead(sorted(hung), HUNG)
        if not hung:  # a failure nobody caused (a network blip): rebuild all the same
            engine.on_dead([])

    def failed_members(self) -> set[int]:
        if not self.failure_reported():
            return set()
        blob = self.c10d.get(P.fail_key(self.engine.announcer.generation)).decode()
        return {int(w) for w in blob.split(",") if w}

    @hold_interrupts()
    def regroup(self) -> None:
        """Regroup the survivors. Online, found while an iteration runs, it ends without an
        update and the new group resumes at the next one; found before it is announced, the new
        group runs it. A block announced ahead, which the replicas run without waiting for the
        coordinator, is left to them: the new group resumes after it, the coordinator reads the
        steps the survivors ran (they publish them, the lowest's unpublished ones too) and ends
        the rest without an update (:meth:`never_ran`), so no update is applied twice, nor
        applied without being logged. The generation lands whole under Ctrl-C (replicas whose
        all-reduce failed wait for it)."""
        engine, state, announcer = self.engine, self.engine.progress, self.engine.announcer
        live_arrivals = engine.reads_arrivals
        if not live_arrivals:
            resume = state.resume_at = max(state.announced, state.begun) + 1
        elif state.admitting is not None:
            state.aborted = True
            self.c10d.set(P.cut_key(state.admitting), repr(time.time()))
            resume = state.admitting + 1
        else:  # found between iterations: the new group runs the coming one
            resume = state.begun + 1
        announcer.members = []  # force a new generation even if nobody died (failure without death)
        engine.new_generation(resume)
        # a step before the resume that is not published once they all joined never will be
        engine.steps.regrouped(resume, announcer.generation, len(announcer.members))
        if not live_arrivals and resume < engine.cfg.iterations:
            # announced now (or the stop): survivors that finished the block wait for it
            if engine.stop_pending:
                self.c10d.set(P.go_key(resume), P.STOP)
            else:
                engine.before_announcing(resume, resume)
                announcer.write(resume, resume, live_arrivals)
                state.announced = resume
        elif resume <= state.announced:  # (a block announced ahead: its keys are at its start)
            announcer.write(resume, state.announced, live_arrivals)

    def never_ran(self, t: int) -> bool:
        """Whether iteration t, of a block the replicas ran ahead when a regrouping ended it,
        has no step and never will: every member of the new generation has joined it, and each
        published the steps it held before it joined. The iteration ends without an update."""
        if t >= self.engine.progress.resume_at:
            return False
        announcer = self.engine.announcer
        joined = self.c10d.add(P.joined_key(announcer.generation), 0)
        return joined >= len(announcer.members) and not self.c10d.check([P.step_key(t)])
