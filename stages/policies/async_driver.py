"""The one sequence every asynchronous update follows, for the simulator and the asynchronous
server: choose K, take gradients in arrival order until K are in (whichever parameters they were
computed on), apply, tell the policy what was seen -- the senders' run-times exactly, every other
worker censored at the time its computation has run so far -- and restart the senders on the new
parameters. A gradient's staleness is the number of updates applied between its read and its
write.

The simulator feeds it recorded run-times on a simulated clock; the server feeds it the gradients
its workers send, on its own clock (any clock: the driver only subtracts its readings). Nothing
else decides K, staleness or censoring, so the two cannot drift apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from bdsgd.stages.policies.base import Policy
from bdsgd.stages.policies.driver import MIN_RUNTIME_S


@dataclass(frozen=True)
class Update:
    """One applied update, as the policy observed it."""

    chosen_k: int  # the K chosen before the update
    order: tuple[int, ...]  # the senders, in arrival order (k-batch-sync: a worker may repeat)
    staleness: np.ndarray  # per sender, in order: updates applied between its read and its write
    runtimes: np.ndarray  # (N,) run-times; censored entries hold the time run so far
    censored: np.ndarray  # (N,) bool
    decision_ms: float  # the policy's choose()
    at: float  # when it was applied, on the caller's clock

    @property
    def c(self) -> int:
        return len(self.order)


class AsyncDriver:
    """Drives one K-gradient policy through updates: :meth:`begin`, :meth:`arrive` until it
    returns True, :meth:`end`, then :meth:`restart` the senders (and every worker, for
    k-batch-sync). ``version`` counts the updates applied (a resumed run sets where it starts)."""

    def __init__(self, policy: Policy, workers: int, version: int = 0) -> None:
        self.policy = policy
        self.version = version
        self.read = np.full(workers, version)  # the version each current computation read
        self.began = np.zeros(workers)  # when each current computation began
        self.runtimes = np.zeros(workers)
        self.arrived = np.zeros(workers, dtype=bool)
        self.order: list[int] = []
        self.k = 0  # K of the update under way (0 before the first)
        self.choose_ms = 0.0

    def begin(self, live: np.ndarray) -> int:
        """Ask the policy for K (capped to 1..live) and start collecting gradients."""
        tic = time.perf_counter()
        k = self.policy.choose(live.copy())
        self.choose_ms = (time.perf_counter() - tic) * 1e3
        self.k = min(max(int(k), 1), max(int(live.sum()), 1))
        self.runtimes[:] = 0.0
        self.arrived[:] = False
        self.order = []
        return self.k

    def arrive(self, worker: int, runtime_s: float) -> bool:
        """A gradient of ``worker`` that took ``runtime_s`` is in; True once K are."""
        self.arrived[worker], self.runtimes[worker] = True, max(runtime_s, MIN_RUNTIME_S)
        self.order.append(worker)
        return len(self.order) >= self.k

    def end(self, now: float, live: np.ndarray | None = None) -> Update:
        """The update is applied at ``now``: the policy observes the senders' run-times exactly,
        every other worker censored at the time its computation has run by ``now`` (one not in
        ``live``, dead, at the longest run-time applied); the version advances."""
        elapsed = np.maximum(now - self.began, MIN_RUNTIME_S)
        if live is not None:
            longest = float(self.runtimes[self.arrived].max()) if self.order else MIN_RUNTIME_S
            elapsed = np.where(live, elapsed, longest)
        runtimes = np.where(self.arrived, self.runtimes, elapsed)
        censored = ~self.arrived
        self.policy.observe(runtimes, censored)
        staleness = self.version - self.read[self.order]
        self.version += 1
        return Update(self.k, tuple(self.order), staleness, runtimes, censored, self.choose_ms, now)

    def restart(self, workers, now: float, fresh: bool = True) -> None:
        """``workers`` begin their next computation at ``now``, on the current parameters (not
        ``fresh``: on the parameters they hold, as after a replayed slot that delivered
        nothing)."""
        self.began[workers] = now
        if fresh:
            self.read[workers] = self.version
