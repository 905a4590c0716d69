"""The one sequence every synchronous iteration follows, for the simulator and both training
engines: choose c, take arrivals one by one (an online policy revises c at each), end at the
revised c, and tell the policy what was seen -- arrivals exactly, everyone else censored at the cut.

The simulator feeds it recorded run-times in arrival order; the engines feed it the tickets their
workers take. Nothing else decides c or censoring, so the two cannot drift apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from stages.policies.base import Policy

MIN_RUNTIME_S = 1e-6  # run-times are positive; a zero clock reading becomes this


@dataclass(frozen=True)
class Outcome:
    """How one iteration ended, as the policy observed it."""

    chosen_c: int  # the c chosen before the iteration
    order: tuple[int, ...]  # admitted workers, in arrival order
    runtimes: np.ndarray  # (N,) run-times; censored entries hold the cut
    censored: np.ndarray  # (N,) bool
    decision_ms: float  # choose() plus the revise() call that ended the iteration

    @property
    def c(self) -> int:
        return len(self.order)

    @property
    def cut_s(self) -> float:
        """The c-th arrival's run-time (0 when nothing arrived)."""
        return float(self.runtimes[list(self.order)].max()) if self.order else 0.0


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
        self.chosen = self.target = 0
        self.choose_ms = self.revise_ms = 0.0

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
        self.revise_ms = 0.0
        return self.chosen

    def arrive(self, worker: int, runtime_s: float) -> bool:
        """A gradient of ``worker`` with ``runtime_s`` is in; True when the iteration ends here.
        An online policy is asked to revise c at every arrival but the last possible one; the
        present is the longest run-time in so far."""
        self.arrived[worker], self.runtimes[worker] = True, max(runtime_s, MIN_RUNTIME_S)
        self.order.append(worker)
        k, live = len(self.order), int(self.live.sum())
        if k >= live:
            return True
        if self.policy.online:
            tic = time.perf_counter()
            now = float(self.runtimes[self.arrived].max())
            self.target = self.policy.revise(now, self.runtimes.copy(), self.arrived & self.live)
            self.revise_ms = (time.perf_counter() - tic) * 1e3
        return k >= self.target

    def end(self, also_censored: np.ndarray | None = None) -> Outcome:
        """Tell the policy the iteration: arrivals exactly, everyone else censored at the cut
        (``also_censored`` marks arrivals known only as lower bounds, e.g. censored trace
        entries). Returns what it observed."""
        cut = float(self.runtimes[self.arrived].max()) if self.order else 0.0
        runtimes = np.where(self.arrived, self.runtimes, max(cut, MIN_RUNTIME_S))
        censored = ~self.arrived
        if also_censored is not None:
            censored = censored | also_censored
        self.policy.observe(runtimes, censored)
        return Outcome(
            self.chosen,
            tuple(self.order),
            runtimes,
            censored,
            self.choose_ms + self.revise_ms,
        )
