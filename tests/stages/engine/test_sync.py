"""The shared synchronous admission (:class:`SyncEngine`), driven by hand on an in-memory store:
tickets whose holders died before naming themselves."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch.distributed as dist
from bdsgd.stages.engine import base
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.sync import SyncEngine
from bdsgd.stages.engine.worker_report import WorkerReport
from bdsgd.stages.policies.cutoff import StaticCutoff
from bdsgd.stages.signals import current_hold, hold_interrupts

from tests.stages.engine.test_engine import engine_config


class HandDriven(SyncEngine):
    """A sync engine with nothing behind it: the test plays the workers through the store."""

    def announce(self, t, limit):
        self.limits = [*getattr(self, "limits", []), limit]

    def apply(self, t, reports, start):
        return 0.0, {"lr": 0.0}

    def finish(self, current):
        pass

    def parameter_state(self):
        return {}

    def load_parameter_state(self, state):
        pass


def dies_after_first_check(victim: int):
    """Liveness where ``victim`` is alive when the iteration begins and dead from then on."""
    seen: set[int] = set()

    def alive(w: int) -> bool:
        if w != victim:
            return True
        first = w not in seen
        seen.add(w)
        return first

    return alive


def take(store, t: int, worker: int, name: bool = True) -> int:
    ticket = store.add(P.ticket_key(t), 1)
    if name:
        store.set(
            P.arrival_key(t, ticket), WorkerReport(worker, t, 0.0, 0.01 * ticket, 1.0, 0.0).encode()
        )
    return ticket


def test_a_ticket_whose_holder_died_unnamed_is_skipped():
    """static:3 of 4: worker 1 takes ticket 1 and dies before writing its report; workers 0 and
    2 hold tickets 2 and 3 (admitted), worker 3 ticket 4 (cut). The engine skips the hole instead
    of waiting on it until the deadline and declaring the live workers dead."""
    cfg = engine_config(timeout_s=60.0)
    store = dist.HashStore()
    engine = HandDriven(cfg, store, StaticCutoff(3), None, dies_after_first_check(1))
    engine.begin(0)
    for worker, name in ((1, False), (0, True), (2, True), (3, False)):
        take(store, 0, worker, name)
    reports = engine.admit(0)
    assert [r.worker for r in reports] == [0, 2]
    assert engine.dead_at == {1: 0}
    assert engine.live.tolist() == [True, False, True, True]
    assert engine.admission.holes == 1


class LosesFirstGradient(HandDriven):
    """As the parameter server does when an admitted worker dies before its gradient lands:
    the report is removed and its worker declared dead."""

    def apply(self, t, reports, start):
        lost = reports[0].worker
        reports[:] = reports[1:]
        self.declare_dead([lost])
        return 0.0, {"lr": 0.0}


def test_the_logged_c_counts_the_gradients_applied_not_those_lost():
    """static:3 of 4, all three admitted name themselves, the first one's gradient is lost: the
    iteration applied 2, with 3 workers left alive, and logs c = 2 (never more than the live)."""
    cfg = engine_config(timeout_s=60.0)
    store = dist.HashStore()
    engine = LosesFirstGradient(cfg, store, StaticCutoff(3), None, lambda w: True)
    rows: list = []
    engine.add_rows = lambda *args: rows.append(args)
    engine.begin(0)
    for worker in (2, 0, 1, 3):
        take(store, 0, worker)
    engine.step(0)
    assert engine.log.rows["c"] == [2]
    assert engine.log.rows["workers"] == [3]
    assert engine.live.tolist() == [True, True, False, True]


def test_a_ctrl_c_held_for_long_is_acknowledged_once(monkeypatch):
    """A block waiting for a slow worker: the held Ctrl-C is acknowledged on the console once
    (not again for a second Ctrl-C of the same hold), and raised when the block ends."""
    monkeypatch.setattr(base, "NOTICE_AFTER_S", 0.05)
    printed: list[str] = []
    monkeypatch.setattr(base.console, "print", lambda text, *a, **k: printed.append(text))
    base.watch_held()  # (as an engine starts it)
    with pytest.raises(KeyboardInterrupt):
        with hold_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            wait_for(lambda: printed)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.6)  # the watcher looks twice meanwhile
    assert len(printed) == 1 and "Ctrl-C" in printed[0]
    assert current_hold() is None  # released with the block: nothing more to notice


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.01)


class LateReport:
    """A store whose ``late`` key lands just as a wait for it times out: a worker that took its
    ticket before a tick and wrote its report a moment later."""

    def __init__(self, late: str, value: bytes):
        self.inner, self.late, self.value = dist.HashStore(), late, value

    def wait(self, keys, timeout):
        if self.late in keys and self.value is not None:
            time.sleep(timeout.total_seconds())
            self.inner.set(self.late, self.value)
            self.value = None
            raise dist.DistStoreError("timed out")
        self.inner.wait(keys, timeout)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Patient(StaticCutoff):
    """Online: waits for every worker at an arrival, stops at the first tick."""

    online = True

    def __init__(self):
        super().__init__(4)
        self.asked: list[tuple[float, int]] = []  # (present, arrivals in)

    def revise(self, now_s, runtimes, arrived):
        self.asked.append((now_s, int(arrived.sum())))
        at_arrival = np.isclose(now_s, runtimes[arrived].max())
        return 4 if at_arrival else int(arrived.sum())


def test_at_a_tick_a_ticket_already_taken_is_read_before_the_policy_is_asked():
    """Worker 0 arrives at 10 ms; worker 2 takes ticket 2, but its report lands only as the
    engine's wait runs into the tick (50 ms after the arrival). The engine reads that report
    before asking the policy at the tick: the policy is asked at both arrivals first."""
    cfg = engine_config(timeout_s=60.0)
    report = WorkerReport(2, 0, 0.0, 0.02, 1.0, 0.0).encode()
    store = LateReport(P.arrival_key(0, 2), report)
    policy = Patient()
    engine = HandDriven(cfg, store, policy, None, lambda w: True)
    engine.begin(0)
    take(store, 0, 0)  # ticket 1, run-time 0.01
    store.add(P.ticket_key(0), 1)  # ticket 2: its report comes late
    reports = engine.admit(0)
    assert [r.worker for r in reports] == [0, 2]
    assert policy.asked[:2] == [(pytest.approx(0.01), 1), (pytest.approx(0.02), 2)]  # no tick


class Recorded(StaticCutoff):
    """static:c that notes, when asked for c, how many announcements the engine had made."""

    def __init__(self, c: int, online: bool, engine_of) -> None:
        super().__init__(c)
        self.online, self.engine_of, self.seen = online, engine_of, []

    def choose(self, live):
        self.seen.append(len(getattr(self.engine_of(), "limits", [])))
        return super().choose(live)


@pytest.mark.parametrize("online", [True, False])
def test_an_online_policy_chooses_after_the_announcement_a_fixed_c_before(online):
    """An online policy's limit is no c, so the workers start first and choose runs while they
    compute; a fixed c is what the announcement carries, so it is chosen first."""
    engines: list = []
    policy = Recorded(3, online, lambda: engines[0])
    engine = HandDriven(engine_config(timeout_s=60.0), dist.HashStore(), policy, None,
                        lambda w: True)  # fmt: skip
    engines.append(engine)
    engine.begin(0)
    assert policy.seen == ([1] if online else [0])
    assert engine.limits == [P.ONLINE if online else 3]
