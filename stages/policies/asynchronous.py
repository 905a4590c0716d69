"""The asynchronous and batch variants of Dutta et al. (AISTATS 2018), as policies.

Their :meth:`choose` returns K, the number of gradients per update; ``mode`` tells the driver how
the workers behave between updates:

- ``k-async:K`` (``mode = "k-async"``): the server applies an update as soon as K gradients have
  arrived, whichever parameters they were computed on. The K workers that sent them wait for that
  update and restart on the fresh parameters; the others keep computing on the parameters they
  started from, and their gradients are applied late (staleness = updates applied between the
  read and the write). ``async`` is ``k-async:1``.
- ``k-batch-sync:K`` (``mode = "k-batch-sync"``): the server waits for K gradients in total, all
  on the current parameters; a worker that finishes restarts at once on the same parameters and
  may contribute again. At the update every unfinished computation is cancelled and everyone
  restarts on the new parameters (no staleness).
- ``adasync`` (``mode = "k-async"``): k-async whose K rises over training ("gradually increasing
  synchrony", Dutta et al.): K starts at ``k0`` and doubles each time another ``period`` gradients
  have been applied, capped at the live workers. Early on, many cheap stale updates make fast
  progress; later, larger K lowers the error floor that staleness causes. Counting gradients
  rather than updates makes each stage an equal share of the work whatever K is.
"""

from __future__ import annotations

import numpy as np
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.policies.base import Policy


class _FixedK(Policy):
    """K gradients per update, capped to the live workers."""

    def __init__(self, k: int, name: str) -> None:
        if k < 1:
            raise ConfigError(f"{name} needs K >= 1, got {k}")
        self.k = k
        self.name = name

    def choose(self, live: np.ndarray) -> int:
        return max(min(self.k, int(live.sum())), 1)

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        """K is fixed: nothing to learn."""


class KAsync(_FixedK):
    """``k-async:K``; ``async`` is ``KAsync(1, name="async")``."""

    mode = "k-async"

    def __init__(self, k: int, name: str | None = None) -> None:
        super().__init__(k, name or f"k-async:{k}")


class KBatchSync(_FixedK):
    """``k-batch-sync:K``."""

    mode = "k-batch-sync"

    def __init__(self, k: int) -> None:
        super().__init__(k, f"k-batch-sync:{k}")


class AdaSync(Policy):
    """``adasync``: K = min(live, k0 * 2 ** (applied // period)). ``applied`` counts the gradients
    of the updates it was asked for (each :meth:`choose` starts one update of K gradients), so
    warm-up observations do not move the schedule."""

    mode = "k-async"

    def __init__(self, period: int, k0: int = 1) -> None:
        if period < 1 or k0 < 1:
            raise ConfigError(f"adasync needs period >= 1 and k0 >= 1, got {period}, {k0}")
        self.name = "adasync"
        self.period = period
        self.k0 = k0
        self.applied = 0

    def current_k(self) -> int:
        """K before capping to the live workers."""
        return self.k0 * 2 ** min(self.applied // self.period, 62)

    def choose(self, live: np.ndarray) -> int:
        k = max(min(self.current_k(), int(live.sum())), 1)
        self.applied += k
        return k

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        """The schedule depends only on the updates chosen."""
