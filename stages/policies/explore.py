"""Exploration: now and then wait for every worker, so that the tail is seen uncensored.

A cutoff policy only ever sees the stragglers it drops as censored values ("at least this long").
The likelihood handles that without bias, but it cannot learn *how* slow the slow tail is from
observations that stop at the cut. A reviewer of Teng & Wood asked whether letting a small
fraction of stragglers run to completion would be worth it; :class:`Exploring` does that for a
chosen fraction of iterations, at a price in throughput that ``bdsgd simulate --explore`` shows.
"""

from __future__ import annotations

import numpy as np
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.policies.base import Policy, forwarded


class Exploring(Policy):
    """``inner`` with c = every live worker in a random ``fraction`` of iterations.

    The inner policy still chooses every iteration (its own state moves as usual) and observes
    everything; only the cutoff is overridden. Name, mode, ``overhead_s`` and the noise scale are
    the inner policy's.
    """

    def __init__(self, inner: Policy, fraction: float, seed: int = 0) -> None:
        if not 0.0 <= fraction < 1.0:
            raise ConfigError(f"--explore must be in [0, 1), got {fraction}")
        if inner.mode != "sync":
            raise ConfigError(f"--explore applies to cutoff policies, not {inner.name!r}")
        self.inner = inner
        self.fraction = fraction
        self.rng = np.random.default_rng(seed)
        self.name = inner.name
        self.online = inner.online
        self.explored = 0
        self._exploring = False

    overhead_s = forwarded("overhead_s")  # type: ignore[assignment]
    salvage_parts = forwarded("salvage_parts")  # type: ignore[assignment]

    def wrapped(self) -> list[Policy]:
        return [self.inner]

    def set_noise_scale(self, noise_scale: float | None, batch_size: int) -> None:
        self.inner.set_noise_scale(noise_scale, batch_size)

    def choose(self, live: np.ndarray) -> int:
        c = self.inner.choose(live)
        self._exploring = self.rng.random() < self.fraction
        if self._exploring:
            self.explored += 1
            return max(int(live.sum()), 1)
        return c

    def revise(self, now_s: float, runtimes: np.ndarray, arrived: np.ndarray) -> int:
        """The inner policy's revision, except in an explored iteration (wait for everyone)."""
        if self._exploring:
            return np.iinfo(np.int32).max
        return self.inner.revise(now_s, runtimes, arrived)

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.inner.observe(runtimes, censored)

    def describe(self) -> dict:
        return self.inner.describe()
