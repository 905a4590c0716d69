"""The policy interface shared by the simulator and the training engine.

A policy sees exactly what the engine sees (the parameter server, or the collective engine's
coordinator), and the simulator shows it the same. Each iteration the driver calls
:meth:`Policy.choose` *before* the workers start, then, once the iteration is over,
:meth:`Policy.observe` with the run-times of the gradients it accepted and, for the workers it cut
off, the censored value (the run-time is >= that value). The driver sets ``overhead_s`` to the
measured fixed cost of an iteration (broadcast, aggregation) so the objective
``c / (E[x_(c)] + overhead_s)`` counts it.

A sync policy with ``online = True`` may also revise c while the iteration runs: the driver calls
:meth:`Policy.revise` at every arrival with what has arrived so far, and the iteration ends at the
first arrival at which the arrivals reach the revised c.

With ``salvage_parts`` set (a training loop that salvages the micro-batches a cut rank finished,
the default), the policies that weigh c count what the cut workers salvage with the c gradients
(``bdsgd.stages.policies.cutoff``).

The driver also pushes, before each :meth:`Policy.choose`, the current gradient noise scale with
:meth:`Policy.set_noise_scale` (``bdsgd.stages.goodput``); only the ``:goodput`` policies use it.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Literal, Protocol

import numpy as np
import torch

Mode = Literal["sync", "k-batch-sync", "k-async"]


class Predictor(Protocol):
    """What the fitted run-time model offers a policy (see ``bdsgd.stages.model.predictor``)."""

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        """Advance the filter by one iteration: (N,) run-times and (N,) censoring flags."""

    def sample(self, num_samples: int) -> torch.Tensor:
        """(S, N) joint samples of the next iteration's run-times, seconds."""

    def remaining(
        self, now_s: float, runtimes: np.ndarray, arrived: np.ndarray, waiting: np.ndarray
    ) -> np.ndarray:
        """(S, n_waiting) joint samples of the waiting workers' run-times in the iteration last
        sampled, given the arrived ones' run-times and that the waiting ones are still running
        at ``now_s`` (optional: a predictor without it serves the fixed-c rule only)."""


class Policy(abc.ABC):
    """Chooses how many gradients the server waits for.

    ``mode`` tells the driver how to run it: ``sync`` (apply the first c gradients of an
    iteration, cut the rest off), ``k-batch-sync`` (wait for K gradients, finished workers start
    again on the same parameters, then everyone restarts) or ``k-async`` (apply every K gradients,
    stragglers keep computing and are applied late).
    """

    name: str = "policy"
    mode: ClassVar[Mode] = "sync"
    overhead_s: float = 0.0
    online: bool = False  # sync only: the driver calls revise() at every arrival
    adaptive: bool = True  # whether c depends on what was observed (False: full, static:C)
    noise_scale: float | None = None  # gradient noise scale B in samples (None: unknown)
    batch_size: int = 1  # the per-worker batch B is measured against
    # micro-batches per step when a cut worker's finished ones count (0: off)
    salvage_parts: int = 0

    @abc.abstractmethod
    def choose(self, live: np.ndarray) -> int:
        """c (or K) for the next iteration, 1 <= c <= live.sum(); ``live`` is an (N,) bool mask of
        the workers still alive."""

    @abc.abstractmethod
    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        """Record one finished iteration: (N,) run-times (seconds) and (N,) bool censoring flags.
        Dead workers appear censored at the cut."""

    def revise(self, now_s: float, runtimes: np.ndarray, arrived: np.ndarray) -> int:
        """Called (when ``online``) at each arrival of a sync iteration, ``now_s`` seconds after
        it began: ``arrived`` (N,) bool marks the live workers whose gradient is in, with their
        ``runtimes``. Returns how many gradients to wait for; a value <= arrived.sum() ends the
        iteration at this arrival. Only called when ``online`` is set."""
        raise NotImplementedError(f"{self.name} does not revise c during an iteration")

    def reveal(self, runtimes: np.ndarray) -> None:  # noqa: B027 (a hook, empty by default)
        """Simulation only: the coming iteration's true run-times, before :meth:`choose`. Every
        policy but the oracle ignores them (the engines never call this)."""

    def set_noise_scale(self, noise_scale: float | None, batch_size: int) -> None:
        """The driver's current estimate of the gradient noise scale (``NoiseScale.value``: None
        while unknown, inf while noise drowns the signal) and the per-worker batch size, set
        before :meth:`choose` like ``overhead_s``. A ``:goodput`` policy values c gradients at
        ``gain(c)`` (``bdsgd.stages.goodput.gain``) instead of c; the others ignore it."""
        self.noise_scale, self.batch_size = noise_scale, batch_size

    def describe(self) -> dict:
        """Extra per-iteration values the driver records (e.g. predicted quantiles)."""
        return {}


def forwarded(name: str) -> property:
    """A setting a wrapping policy holds for the policies it wraps (``self.wrapped()``, the
    first one read): ``overhead_s = forwarded("overhead_s")``. A driver sets it on the wrapper
    as on any policy."""

    def get(self):
        return getattr(self.wrapped()[0], name)

    def put(self, value) -> None:
        for policy in self.wrapped():
            setattr(policy, name, value)

    return property(get, put)


def observe_run(policy: Policy, run, before: int | None = None) -> int:
    """Feed ``policy`` a run's iterations (before ``before``) as it saw them: arrivals exactly,
    the rest censored; returns how many."""
    rows = np.flatnonzero(run.present[:before].any(axis=1))
    for t in rows:
        seen = run.present[t]  # a worker with no row (dead) is censored at the slowest seen
        runtimes = np.where(seen, run.runtimes[t], run.runtimes[t][seen].max())
        policy.observe(runtimes, run.censored[t] | ~seen)
    return int(rows.size)
