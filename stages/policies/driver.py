"""The one sequence every synchronous iteration follows, for the simulator and both training
engines: choose c, take arrivals one by one (an online policy revises c at each), end at the
revised c, and tell the policy what was seen -- arrivals exactly, everyone else censored at the cut.

An online policy that decided at an arrival to wait for more is asked again while nothing
arrives (:meth:`IterationDriver.wait`): ``TICK_S`` after the last arrival, then after twice as
long, and so on. A worker later than the arrivals suggested changes what waiting is worth; asked
only at arrivals, a policy that chose to wait for the last worker waited for it however long it
took (1.8 s for a 60 ms iteration, seen on a replayed cluster). Cut at a tick, the iteration
ends there, and the workers still out are censored at that time (an engine, as after any cut,
also admits a worker that took its ticket before the close reached the store).

The simulator feeds it recorded run-times in arrival order; the engines feed it the tickets their
workers take. Nothing else decides c or censoring, so the two cannot drift apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from bdsgd.stages.policies.base import Policy

MIN_RUNTIME_S = 1e-6  # run-times are positive; a zero clock reading becomes this
TICK_S = 0.05  # an online iteration waiting this long after an arrival is revised again
MAX_TICKS = 40  # between two arrivals (a worker that never arrives in a replay)


@dataclass(frozen=True)
class Outcome:
    """How one iteration ended, as the policy observed it."""

    chosen_c: int  # the c chosen before the iteration
    order: tuple[int, ...]  # admitted workers, in arrival order
    runtimes: np.ndarray  # (N,) run-times; censored entries hold the cut
    censored: np.ndarray  # (N,) bool
    decision_ms: float  # choose() plus the revise() call that ended the iteration
    cut_s: float = 0.0  # when it was cut: the c-th arrival's run-time, or a later tick

    @property
    def c(self) -> int:
        return len(self.order)


class IterationDriver:
    """Drives one policy through synchronous iterations: :meth:`begin`, :meth:`arrive` until it
    returns True (or arrivals run out), :meth:`end`."""

    def __init__(self, policy: Policy, workers: int) -> None:
        self.policy = policy
        self.workers = workers
        self.live = np.ones(workers, dtype=bool)
        self.runtimes = np.zeros(workers)
        self.arrived = np.zeros(workers, dtype=bool)
        self.order: list[int] = []
        self.late: dict[int, float] = {}  # worker -> run-time: finished after the cut
        self.chosen = self.target = 0
        self.choose_ms = self.revise_ms = 0.0
        self.latest = 0.0  # the longest run-time arrived so far: the present at the last arrival
        self.next_tick: float | None = None  # when a waiting online policy is asked again
        self.cut_at = 0.0  # a tick that ended the iteration

    def begin(self, live: np.ndarray) -> int:
        """Ask the policy for c (capped to 1..live) and start collecting arrivals."""
        self.live = live.copy()
        tic = time.perf_counter()
        c = self.policy.choose(live.copy())
        self.choose_ms = (time.perf_counter() - tic) * 1e3
        self.chosen = self.target = min(max(int(c), 1), max(int(live.sum()), 1))
        self.runtimes[:] = 0.0
        self.arrived[:] = False
        self.order = []
        self.late = {}
        self.revise_ms = self.latest = self.cut_at = 0.0
        self.next_tick = None
        return self.chosen

    def arrive(self, worker: int, runtime_s: float, revise: bool = True) -> bool:
        """A gradient of ``worker`` with ``runtime_s`` is in; True when the iteration ends here.
        The arrival of the c standing before it ends the iteration (in training the rank that
        takes that ticket cuts the others at once); before, an online policy is asked to revise
        c at every arrival (not with ``revise=False``: an arrival admitted after the cut, or not
        the last of a batch); the present is the longest run-time in so far."""
        self.arrived[worker], self.runtimes[worker] = True, max(runtime_s, MIN_RUNTIME_S)
        self.order.append(worker)
        k, live = len(self.order), int(self.live.sum())
        if k >= live or k >= self.target:  # the standing c arrived: its holder cut (the loop's)
            return True
        if self.policy.online and revise:
            self.latest = float(self.runtimes[self.arrived].max())
            self.revise(self.latest)
            self.next_tick = self.latest + TICK_S
        return k >= self.target

    def arrive_all(self, arrivals: list[tuple[int, float]]) -> bool:
        """Gradients read together, ``(worker, runtime_s)`` in arrival order: each is admitted
        (their tickets precede any close, whatever the policy would have said between them) and
        an online policy revises once, at the last. True when the iteration ends there. A
        coordinator that reads arrivals in batches pays one revision per batch: at 1,024 ranks
        one per arrival cost more CPU than the ~30 ms over which the arrivals came."""
        ends = False
        for i, (worker, runtime_s) in enumerate(arrivals):
            ends = self.arrive(worker, runtime_s, revise=i == len(arrivals) - 1)
        return ends

    def wait(self, now_s: float) -> bool:
        """``now_s`` into the iteration, nothing new arrived: at a due tick an online policy
        that chose to wait is asked again, with the present ``now_s``. True when it stops the
        iteration here (cut at ``now_s``)."""
        if self.next_tick is None or now_s < self.next_tick or len(self.order) >= self.target:
            return False
        self.next_tick = self.latest + 2 * (self.next_tick - self.latest)
        self.revise(now_s)
        if len(self.order) < self.target:
            return False
        self.cut_at = now_s
        return True

    def wait_until(self, arrival_s: float) -> bool:
        """Every tick due before an arrival at ``arrival_s`` (the simulator's replay of the
        engines' waits): True when one of them stops the iteration."""
        for _ in range(MAX_TICKS):  # a doubling wait: 40 ticks span 1,700 years
            if self.next_tick is None or self.next_tick >= arrival_s:
                break
            if self.wait(self.next_tick):
                return True
        return False

    def revise(self, now_s: float) -> None:
        tic = time.perf_counter()
        self.target = self.policy.revise(now_s, self.runtimes.copy(), self.arrived & self.live)
        self.revise_ms = (time.perf_counter() - tic) * 1e3

    def arrive_late(self, worker: int, runtime_s: float) -> None:
        """A worker that finished its whole batch after the cut (a training loop's rank too late
        for its ticket): not admitted, but its run-time is exact, not censored at the cut."""
        self.late[worker] = max(runtime_s, MIN_RUNTIME_S)

    def end(self, also_censored: np.ndarray | None = None) -> Outcome:
        """Tell the policy the iteration: arrivals exactly, everyone else censored at the cut
        (``also_censored`` marks arrivals known only as lower bounds, e.g. censored trace
        entries). Returns what it observed."""
        cut = max(float(self.runtimes[self.arrived].max()) if self.order else 0.0, self.cut_at)
        runtimes = np.where(self.arrived, self.runtimes, max(cut, MIN_RUNTIME_S))
        censored = ~self.arrived
        for worker, runtime_s in self.late.items():
            runtimes[worker], censored[worker] = max(runtime_s, cut), False
        if also_censored is not None:
            censored = censored | also_censored
        self.policy.observe(runtimes, censored)
        return Outcome(
            self.chosen,
            tuple(self.order),
            runtimes,
            censored,
            self.choose_ms + self.revise_ms,
            cut,
        )
