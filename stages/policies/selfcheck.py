"""A bdsgd that watches itself: when its own predictive has been losing, it leans on a simple peer.

The model earns its place only where it beats the simple policies. On a cluster unlike the ones
it was built for (heavy, nearly independent tails; a load level it was not fitted on) it may
not, and nothing else would tell. :class:`SelfChecking` runs the simple peers (``ewma`` and
``ecdf`` with the long-run objective, fixed c) beside the model's policy, *in the shadow*: every
iteration each expert that did not decide is asked what it would have chosen (from its state
before the iteration, as if it had decided) and scored on the iteration's actual arrivals:

- its c arrived (c <= the gradients that arrived): the iteration would have taken x_(c), exact;
- an online expert (``bdsgd``) is replayed arrival by arrival through its own ``revise``, so it
  is scored on where it would have stopped, not on the c it chose first;
- it would have waited for gradients that did not arrive (they were cut off, censored): the
  expected x_(c) under the conditional, given what arrived and that the rest were still
  running at the cut, of the expert that *decided* the iteration (the referee). Judged by its
  own conditional instead, an expert that misreads the stragglers flatters itself exactly where
  the data cannot check it: an ``ewma`` that averages a known slow iteration with the fast ones
  imputes "the rest arrive just after the cut" and looked 25% better than it was in a test.
  The referee's view makes the current choice sticky (it judges the others): so an imputed
  outcome moves a score a quarter as much as an exact one (``IMPUTED_WEIGHT``), and the exact
  record (an expert whose stop is among the arrivals; every expert on uncensored history)
  dominates.

Each expert's score is its realised rate, the ratio of exponentially weighted sums of gradients
and of seconds (about the last 1 / ``alpha`` iterations; a ratio of sums needs no bias correction). The policy follows the
model unless a peer's rate is ahead of the model's by more than ``margin``; it then plays that
peer's c, and goes back when the model's rate is again at least the peer's. Iterations observed
without a decision (a warm-up on recorded history, ``simulate --from-frac``, ``train`` resuming)
score every expert, so a cluster where the model loses is recognised before the first decision.

A record counts once it holds ``min_scored`` iterations: enough for about ``RECORD_RUNTIMES``
run-times (:func:`record_needed`: 20 iterations at N = 32, 3 at N = 256), since what makes a
comparison of rates trustworthy is how many arrivals it saw. So on a 30-iteration run of 256
workers the check can lean from its fourth decision. On a cluster of at most 16 workers it is
``SMALL_RECORD`` (8) iterations: there a wrong c costs a large share of every iteration.

A policy built from a checkpoint that ``fit`` marked unusable (``trusted`` False) never lets the
model decide, nor runs it: it plays the first peer from the first iteration and then the best
peer by the same scores. One that ``fit`` marked only uncalibrated (``probation``: its held-out
NLL beat the pooled window's, its PITs did not pass) starts the same way, but runs and scores the
model in the shadow like any peer: once the model's record is full and its rate leads the peer
followed by more than ``margin``, the model decides, and from then on the rules above apply.
A job whose short profile left the model's shape off (a host's slow spells, the EWMAs dragged up
after them) thus gets the model where it pays and its peers where it does not.

It does not wait for a record when the run's **first iteration lies far outside the model's
predictive** (:func:`far_outside`: its level, the median log run-time, more than
``SURPRISE_Z`` sds of the predicted levels from their mean): that says the model was fitted on
another cluster, or on other loads, than the one it runs on, before any iteration was lost to
it. The policy then leans on the best peer at once, every record starts afresh from the next
iteration, and it goes back to the model as soon as the model's fresh record is at least the
peer's (the rule above, with no minimum record).

Each expert learns from every iteration as usual; its lambda (the going rate of the long-run
objective) counts its own shadow gradients and seconds, not the played ones.
"""

from __future__ import annotations

import math

import numpy as np
from bdsgd.stages.policies.base import Policy, forwarded
from bdsgd.stages.policies.cutoff import MonteCarloCutoff, sorted_samples
from bdsgd.stages.policies.driver import IterationDriver
from bdsgd.stages.policies.floor import SMALL_N

IMPUTED_WEIGHT = 0.25  # an imputed shadow outcome moves a score a quarter as much as an exact one
RECORD_RUNTIMES = 640  # run-times a record holds before it may decide (20 iterations at N = 32)
MIN_RECORD = 3  # ... and never fewer iterations than this
SMALL_RECORD = 8  # iterations a record needs on a cluster of at most SMALL_N workers
SURPRISE_Z = 4.0  # a first iteration whose level lies further out (in sds) leans at once


def record_needed(num_workers: int) -> int:
    """Iterations an expert's record needs before it may decide: about ``RECORD_RUNTIMES``
    run-times, at least ``MIN_RECORD`` iterations; on a cluster of at most ``SMALL_N`` workers
    ``SMALL_RECORD`` iterations (there one gradient is a large share of an iteration, a wrong
    c shows in every iteration's length, and a job of a few hundred steps cannot wait 160)."""
    if num_workers <= SMALL_N:
        return SMALL_RECORD
    return max(MIN_RECORD, math.ceil(RECORD_RUNTIMES / max(num_workers, 1)))


def far_outside(ordered: np.ndarray | None, runtimes: np.ndarray, live: np.ndarray) -> float:
    """How far (in sds of the predicted levels, signed) an iteration's level lies from the
    predictive's: the level is the median log run-time of the live workers, censored ones at
    their bound (exact while fewer than half are censored), of a draw its middle order
    statistic; ``ordered`` are the (S, n_live) sorted draws behind the decision (0.0 without)."""
    seen = np.sort(np.log(np.asarray(runtimes, dtype=float)[live]))
    if ordered is None or ordered.shape[0] < 2 or ordered.shape[1] != seen.size or not seen.size:
        return 0.0
    levels = np.log(ordered[:, seen.size // 2])
    return float((seen[seen.size // 2] - levels.mean()) / max(levels.std(), 1e-12))


class ShadowScore:
    """An expert's realised rate: exponentially weighted sums of gradients and seconds."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.gradients = 0.0
        self.seconds = 0.0
        self.count = 0

    def update(self, gradients: float, seconds: float, weight: float = 1.0) -> None:
        a = self.alpha * weight
        self.gradients = (1 - a) * self.gradients + a * gradients
        self.seconds = (1 - a) * self.seconds + a * seconds
        self.count += 1

    def rate(self) -> float:
        return self.gradients / self.seconds if self.seconds > 0 else 0.0


class SelfChecking(Policy):
    """``own`` (the model's policy) with ``peers`` scored in its shadow; see the module docstring.

    ``describe()`` adds ``peer``: the name of the peer whose c was played, or None while the
    model decides. :meth:`report` summarises how often, and from when, the policy leaned.
    """

    def __init__(
        self,
        own: MonteCarloCutoff,
        peers: list[MonteCarloCutoff],
        alpha: float = 0.01,
        margin: float = 0.01,
        min_scored: int = 20,
        trusted: bool = True,
        probation: bool = False,
    ) -> None:
        self.own = own
        # fit's mark, as built: None, "probation" (own runs in the shadow and may earn its
        # place: earned_at) or "unusable" (own is neither run nor scored)
        self.marked = None if trusted or not peers else "probation" if probation else "unusable"
        self.earned_at: int | None = None  # on probation: the decision from which own decided
        self.experts: list[MonteCarloCutoff] = [own, *peers]
        self.scores = [ShadowScore(alpha) for _ in self.experts]
        self.margin = margin
        self.min_scored = min_scored
        self.name = own.name
        self.online = own.online
        self.leader = 0 if self.trusted else 1  # index into experts: 0 is the model
        self._played: int | None = None  # the expert deciding the iteration under way
        self._shown = 0  # the expert describe() reports on: the one that decided the last
        self._chosen = 0
        self._live: np.ndarray | None = None
        self.decided = 0
        self.leaned = 0
        self.first_leaned: int | None = None
        self.leaned_to: dict[str, int] = {}
        self.observed = 0  # iterations observed, decided or not
        self.surprise: float | None = None  # the first iteration's distance (far_outside)

    overhead_s = forwarded("overhead_s")  # type: ignore[assignment]
    salvage_parts = forwarded("salvage_parts")  # type: ignore[assignment]

    def wrapped(self) -> list[Policy]:
        """The model's policy first, then the peers: each holds the driver's settings."""
        return self.experts

    def set_noise_scale(self, noise_scale: float | None, batch_size: int) -> None:
        for expert in self.experts:
            expert.set_noise_scale(noise_scale, batch_size)

    def choose(self, live: np.ndarray) -> int:
        self._live = np.asarray(live, dtype=bool).copy()
        self._played = self.leader
        self._chosen = self.experts[self.leader].choose(live)
        if self.leader:
            name = self.experts[self.leader].name
            self.leaned += 1
            self.leaned_to[name] = self.leaned_to.get(name, 0) + 1
            self.first_leaned = self.decided if self.first_leaned is None else self.first_leaned
        self.decided += 1
        return self._chosen

    def revise(self, now_s: float, runtimes: np.ndarray, arrived: np.ndarray) -> int:
        """The model's online revision while it decides; a peer's c (fixed) while leaning."""
        expert = self.experts[self._played if self._played is not None else 0]
        if expert.online:
            return expert.revise(now_s, runtimes, arrived)
        return self._chosen

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        """Score every expert on the iteration (the one that decided it exactly, the others in
        its shadow, before anyone learns from it), then let each learn and pick the leader."""
        runtimes = np.asarray(runtimes, dtype=float)
        censored = np.asarray(censored, dtype=bool)
        arrived = ~censored & np.isfinite(runtimes) & (runtimes > 0)
        live = self._live if self._live is not None else np.ones(runtimes.shape, dtype=bool)
        played = self._played
        outcomes = []
        for i, expert in enumerate(self.experts):
            if i == 0 and self.shelved:
                outcomes.append((0, 0.0, False))  # the model is neither run nor scored
            elif i == played:
                seconds = float(runtimes[arrived].max(initial=0.0)) + expert.overhead_s
                outcomes.append((int(arrived.sum()), seconds, True))
            else:
                referee = self.experts[played] if played is not None else expert
                outcomes.append(shadow_outcome(expert, live, runtimes, arrived, referee))
        for i, expert in enumerate(self.experts):
            gradients, seconds, exact = outcomes[i]
            if i == 0 and self.shelved:
                continue
            if i == played:
                expert.observe(runtimes, censored)
            else:
                expert.observe_shadow(runtimes, censored, gradients, seconds)
            judge = self.experts[played] if played is not None else expert
            worth = judge.worth_of_count()  # k, with what its cut ones salvage (:goodput: gain)
            value = gradients if worth is None else worth(gradients)
            self.scores[i].update(value, seconds, 1.0 if exact else IMPUTED_WEIGHT)
        self._shown = played if played is not None else self.leader
        self._played, self._live = None, None
        if self.observed == 0 and self.trusted:
            self.surprise = far_outside(self.own._ordered, runtimes, live)
        self.observed += 1
        if self.probation and self.earned():
            self.leader, self.earned_at = 0, self.decided
        elif not self.trusted:
            self.leader = self.best_peer()
        elif self.surprise is not None and abs(self.surprise) > SURPRISE_Z and self.observed == 1:
            self.leader = self.surprised()
        else:
            self.leader = self.next_leader()

    @property
    def trusted(self) -> bool:
        """The model may decide: unmarked, or it earned its place on probation."""
        return self.marked is None or self.earned_at is not None

    @property
    def probation(self) -> bool:
        """On probation and not yet earned: the model runs and is scored in the shadow."""
        return self.marked == "probation" and self.earned_at is None

    @property
    def shelved(self) -> bool:
        """The model is neither run nor scored (a checkpoint marked unusable)."""
        return self.marked == "unusable"

    def earned(self) -> bool:
        """On probation: the model's record is full and its rate leads the peer followed by
        more than ``margin``."""
        rates = [s.rate() for s in self.scores]
        full = self.scores[0].count >= self.min_scored
        return full and rates[0] > rates[self.leader] * (1 + self.margin)

    def best_peer(self) -> int:
        """The peer followed while the model may not decide: the one followed so far unless
        another's rate leads it by more than ``margin``."""
        rates = [s.rate() for s in self.scores]
        best = 1 + int(np.argmax(rates[1:]))
        return best if rates[best] > rates[self.leader] * (1 + self.margin) else self.leader

    def surprised(self) -> int:
        """The first iteration lay far outside the model's predictive: lean on the best peer so
        far (the first on a tie) at once, every record starting afresh."""
        rates = [s.rate() for s in self.scores]
        best = 1 + int(np.argmax(rates[1:]))
        self.scores = [ShadowScore(s.alpha) for s in self.scores]
        return best

    def next_leader(self) -> int:
        """The model, unless a peer's rate leads the model's by more than ``margin``. While
        leaning on a peer: back to the model once its rate is at least that peer's, to another
        peer only if it leads the one followed by more than ``margin``."""
        if len(self.experts) < 2:
            return 0
        rates = [s.rate() for s in self.scores]
        best = 1 + int(np.argmax(rates[1:]))
        if self.leader:
            if self.scores[0].count and rates[0] >= rates[self.leader]:
                return 0
            return best if rates[best] > rates[self.leader] * (1 + self.margin) else self.leader
        if self.scores[0].count < self.min_scored:
            return 0
        return best if rates[best] > rates[0] * (1 + self.margin) else 0

    def describe(self) -> dict:
        played = self._shown if self._played is None else self._played
        out = dict(self.experts[played].describe())
        out["peer"] = self.experts[played].name if played else None
        return out

    def report(self) -> dict:
        """How often the policy leaned on a peer: iterations decided, leaned (per peer), the
        first decided iteration it leaned on, and every expert's realised rate (grad/s)."""
        return {
            "decided": self.decided,
            "leaned": self.leaned,
            "leaned_share": self.leaned / self.decided if self.decided else 0.0,
            "first_leaned": self.first_leaned,
            "leaned_to": dict(self.leaned_to),
            "first_iteration_z": None if self.surprise is None else round(self.surprise, 2),
            "model_usable": self.marked is None,
            "on_probation": self.marked == "probation",
            "earned_at": self.earned_at,
            "rates": {
                e.name: round(s.rate(), 6) for e, s in zip(self.experts, self.scores, strict=True)
            },
        }


def shadow_outcome(
    expert: MonteCarloCutoff,
    live: np.ndarray,
    runtimes: np.ndarray,
    arrived: np.ndarray,
    referee: MonteCarloCutoff | None = None,
) -> tuple[int, float, bool]:
    """Gradients and seconds (with the fixed cost) of the iteration had ``expert`` decided it,
    on its actual arrivals (``arrived`` with their ``runtimes``; the rest cut off at the
    largest arrival), driven through the same :class:`IterationDriver` as a played iteration
    (an online expert revises at every arrival and at the ticks between them, and may stop at
    one); and whether that is exact (its stop is among the arrivals or the ticks before the
    last) or imputed, by the ``referee``'s conditional (default: the expert's own); see the
    module docstring."""
    driver = IterationDriver(expert, runtimes.size)
    target = driver.begin(live)
    order = np.flatnonzero(arrived)[np.argsort(runtimes[arrived], kind="stable")]
    o = expert.overhead_s
    if not expert.online and target <= order.size:  # a fixed c among the arrivals: no replay
        return target, float(runtimes[order[target - 1]]) + o, True
    for w in order if expert.online else ():
        if driver.wait_until(float(runtimes[w])):  # cut at a tick before this arrival
            return len(driver.order), driver.cut_at + o, True
        if driver.arrive(int(w), float(runtimes[w])):
            return len(driver.order), float(runtimes[w]) + o, True
    target = min(driver.target, int(live.sum()))  # beyond the arrivals: it would have waited
    cut = float(runtimes[order[-1]]) if order.size else 0.0
    more = beyond_cut(referee or expert, cut, runtimes, arrived, live, target - order.size)
    return target, more + o, False


def beyond_cut(
    referee: MonteCarloCutoff,
    cut: float,
    runtimes: np.ndarray,
    arrived: np.ndarray,
    live: np.ndarray,
    more: int,
) -> float:
    """E[time of the ``more``-th arrival after the cut] under the ``referee``'s conditional given
    the arrivals and that the rest were still running at ``cut`` (the cut itself when it
    cannot condition)."""
    waiting = live & ~arrived
    if not waiting.any():
        return cut
    draws = referee.conditional(cut, np.where(arrived, runtimes, 0.0), arrived, waiting)
    if draws is None or draws.shape[1] == 0:
        return cut
    column = min(more, draws.shape[1]) - 1
    return max(float(sorted_samples(draws)[:, column].mean()), cut)


def self_check_report(policy: Policy) -> dict | None:
    """:meth:`SelfChecking.report` of ``policy`` (or of the policy it wraps, e.g. under
    ``--explore``); None for a policy that does not watch itself."""
    while not isinstance(policy, SelfChecking):
        policy = getattr(policy, "inner", None)
        if policy is None:
            return None
    return policy.report()


def lean_message(name: str, report: dict | None) -> str | None:
    """A warning (rich markup) when a self-checking policy played a peer's c because its own
    predictive was losing on this cluster; None when it did not, or does not check itself."""
    if not report or not report["leaned"]:
        return None
    peers = ", ".join(f"{peer} {count}" for peer, count in report["leaned_to"].items())
    if report.get("on_probation"):
        earned = report.get("earned_at")
        how = ("the model never led them" if earned is None
               else f"the model decided from its decision {earned} on, when its record led")  # fmt: skip
        return (
            f"[yellow]{name}'s model was marked uncalibrated: its simple peers decided "
            f"{report['leaned']} of {report['decided']} iterations ({peers}); {how}[/]"
        )
    return (
        f"[yellow]{name} leaned on a simple peer in {report['leaned']} of {report['decided']} "
        f"iterations ({peers}; first at its decision {report['first_leaned']}): its own "
        "predictive was losing to the peer on this cluster[/]"
    )
