"""Policy specs (``--policy``/``--policies``) to policy objects, for the simulator and the trainer.

Specs: ``full``, ``static:C``, ``elfving``, ``ecdf``, ``ewma``, ``bdsgd`` (needs a checkpoint),
each of the last three optionally followed by ``:long-run`` (the default objective) or
``:iteration`` (the per-iteration rate c / E[x_(c)]) and by ``:online`` or ``:fixed`` (revise c at
every arrival, or keep the c chosen before the iteration; ``bdsgd`` is online by default, ``ecdf``
and ``ewma`` fixed; see ``bdsgd.stages.policies.cutoff``), ``k-batch-sync:K``, ``k-async:K``,
``async``, ``adasync[:GRADIENTS]`` (K doubles every GRADIENTS applied), ``oracle`` (simulation
only). ``elfving``, ``ecdf``, ``ewma`` and ``bdsgd`` also take ``:goodput``: value c gradients at
gain(c) from the gradient noise scale (``bdsgd.stages.goodput``), not at c. ``bdsgd`` watches itself
against ``ewma`` and ``ecdf`` and plays their c while its own predictive has been losing
(``bdsgd.stages.policies.selfcheck``); ``bdsgd:unchecked`` never does.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from bdsgd.stages.console import console
from bdsgd.stages.errors import CheckpointError, ConfigError
from bdsgd.stages.policies.asynchronous import AdaSync, KAsync, KBatchSync
from bdsgd.stages.policies.base import Policy
from bdsgd.stages.policies.cutoff import (
    BdsgdCutoff,
    EcdfCutoff,
    ElfvingCutoff,
    EwmaCutoff,
    FullSync,
    OracleCutoff,
    StaticCutoff,
)
from bdsgd.stages.policies.explore import Exploring
from bdsgd.stages.policies.selfcheck import SelfChecking, record_needed
from bdsgd.stages.policy_names import (
    LEARNING,
    MONTE_CARLO,
    NEEDS_MODEL,
    SPECS,  # noqa: F401 (bdsgd.stages.policies exports it)
    UNCHECKED,
    check_spec,
)
from bdsgd.stages.policy_names import count as _count
from bdsgd.stages.policy_names import elfving_goodput as _elfving_goodput
from bdsgd.stages.policy_names import monte_carlo_options as _monte_carlo_options
from bdsgd.stages.policy_names import unknown as _unknown

ADASYNC_DEFAULT_PERIOD = 100


def make_policy(
    spec: str,
    num_workers: int,
    checkpoint: str | os.PathLike | None = None,
    hosts: list[str] | None = None,
    *,
    overhead_s: float = 0.0,
    seed: int = 0,
    iterations: int | None = None,
    num_samples: int = 256,
    explore: float = 0.0,
) -> Policy:
    """Build the policy named by ``spec`` for a cluster of ``num_workers``.

    ``checkpoint``/``hosts`` serve ``bdsgd`` (the model is loaded only for it); ``iterations``
    (computations per worker in the run) sets adasync's default period so that K reaches N for
    the last stage (without it: K doubles every 100 * N gradients); ``overhead_s`` is the measured
    fixed cost of an iteration; ``explore`` > 0 makes the learning cutoff policies (``elfving``,
    ``ecdf``, ``ewma``, ``bdsgd``) wait for every worker in that fraction of iterations (see
    ``bdsgd.stages.policies.explore``). Raises :class:`ConfigError` with a one-line message on a bad spec.
    """
    check_spec(spec, num_workers)
    kind, _, arg = spec.strip().partition(":")
    policy = _build(kind, arg, spec, num_workers, checkpoint, hosts, seed, iterations, num_samples)
    if explore > 0 and kind in LEARNING:
        policy = Exploring(policy, explore, seed=seed)
    elif not 0.0 <= explore < 1.0:
        raise ConfigError(f"--explore must be in [0, 1), got {explore}")
    policy.overhead_s = overhead_s
    return policy


def _build(
    kind, arg, spec, num_workers, checkpoint, hosts, seed, iterations, num_samples
) -> Policy:
    checked = kind == "bdsgd" and UNCHECKED not in arg.split(":")
    arg = ":".join(w for w in arg.split(":") if w != UNCHECKED) if kind == "bdsgd" else arg
    mc = _monte_carlo_options(arg, spec, kind) if kind in MONTE_CARLO else {}
    simple = {
        "full": FullSync,
        "oracle": OracleCutoff,
        "elfving": lambda: ElfvingCutoff(goodput=_elfving_goodput(arg, spec)),
        "ecdf": lambda: EcdfCutoff(num_samples=num_samples, seed=seed, **mc),
        "ewma": lambda: EwmaCutoff(num_workers, num_samples=num_samples, seed=seed, **mc),
        "async": lambda: KAsync(1, name="async"),
    }
    if kind in simple:
        return simple[kind]()
    if kind == "static":
        return StaticCutoff(_count(arg, spec, num_workers))
    if kind == "k-batch-sync":
        return KBatchSync(_count(arg, spec, num_workers))
    if kind == "k-async":
        return KAsync(_count(arg, spec, num_workers))
    if kind == "adasync":
        return AdaSync(_count(arg, spec, None) if arg else _adasync_period(num_workers, iterations))
    if kind == "bdsgd":
        predictor, mark = _load_predictor(checkpoint, num_workers, hosts, seed)
        num_samples = decision_samples(num_samples, num_workers)
        own = BdsgdCutoff(predictor, num_samples=num_samples, **mc)
        if mark is not None:
            policy = with_self_check(own, num_workers, seed, num_samples, mc, trusted=False,
                                     probation=mark.probation)  # fmt: skip
            console.print(fallback_message(spec, checkpoint, mark, policy), soft_wrap=True)
            return policy
        if not checked:
            own.name += f":{UNCHECKED}"
            return own
        return with_self_check(own, num_workers, seed, num_samples, mc)
    raise _unknown(spec)


LARGE_N, LARGE_S = 256, 32  # from LARGE_N workers on, a decision draws LARGE_S samples


def decision_samples(num_samples: int, num_workers: int) -> int:
    """S for bdsgd (and its peers): ``num_samples`` up to N = 64, then fewer, down to 64 at
    N = 255 (16384 / N), and 32 from N = 256 on. Each joint sample orders N run-times, so the
    order statistics a decision needs are steady with fewer samples at large N, and sampling,
    sorting and the online conditional cost S x N. At N = 256 and 1,024 the oracle ratios with
    32 samples matched those with 64 on every held-out cluster of that size (better on some),
    and the decision costs 20-30% less (docs/benchmarks.md, issue 32)."""
    if num_workers >= LARGE_N:
        return min(num_samples, LARGE_S)
    return min(num_samples, max(64, 16384 // num_workers))


def with_self_check(
    own,
    num_workers: int,
    seed: int,
    num_samples: int,
    mc: dict,
    trusted: bool = True,
    probation: bool = False,
) -> SelfChecking:
    """``own`` (bdsgd) watched by its simple peers, ``ewma`` and ``ecdf`` with the same objective
    and goodput setting and a fixed c (``bdsgd.stages.policies.selfcheck``). ``trusted`` False
    (a checkpoint marked unusable): the peers decide from the first iteration, never the model;
    with ``probation`` (marked only uncalibrated) until the model's shadow record leads."""
    peer = {**mc, "stopping": "fixed"}
    peers = [
        EwmaCutoff(num_workers, num_samples=num_samples, seed=seed, **peer),
        EcdfCutoff(num_samples=num_samples, seed=seed, **peer),
    ]
    return SelfChecking(own, peers, min_scored=record_needed(num_workers), trusted=trusted,
                        probation=probation)  # fmt: skip


def fallback_message(spec: str, checkpoint, mark: Mark, policy: SelfChecking) -> str:
    """The one line a ``bdsgd`` policy built from a marked checkpoint prints."""
    peers = ", ".join(e.name for e in policy.experts[1:])
    if mark.probation:  # (its reason, fit's line, says what this line says and more)
        return (
            f"[yellow]{spec}: {checkpoint} is marked uncalibrated by fit; playing its simple "
            f"peers ({peers}) until the model's own record in their shadow leads them[/]"
        )
    why = f" ({mark.reason})" if mark.reason else ""
    return (
        f"[yellow]{spec}: {checkpoint} is marked unusable{why}; playing its simple peers "
        f"({peers}) from the first iteration[/]"
    )


def _adasync_period(num_workers: int, iterations: int | None) -> int:
    """Gradients between doublings of K: the ``iterations * num_workers`` gradients of a run are
    split into equal stages, the last one at K = N."""
    if iterations is None:
        return ADASYNC_DEFAULT_PERIOD * num_workers
    stages = math.ceil(math.log2(num_workers)) + 1
    return max(1, iterations * num_workers // stages)


def _load_predictor(checkpoint, num_workers: int, hosts: list[str] | None, seed: int):
    if checkpoint is None:
        raise ConfigError(NEEDS_MODEL)
    from bdsgd.stages.model.checkpoint import load_checkpoint
    from bdsgd.stages.model.predictor import predictor_from

    ckpt = load_checkpoint(checkpoint)
    check_same_cluster(ckpt.vocab.host_names, hosts, checkpoint)
    predictor = predictor_from(ckpt, workers=list(range(num_workers)), hosts=hosts, seed=seed)
    return predictor, fit_mark(ckpt)


@dataclass(frozen=True)
class Mark:
    """``fit``'s mark on a checkpoint it would not have a policy lean on: why (the first line of
    ``unusable_reason``; "" without one), and whether only its calibration failed
    (``probation``: the model may still earn its place in the self-check's shadow)."""

    reason: str
    probation: bool


def fit_mark(ckpt) -> Mark | None:
    """The checkpoint's :class:`Mark` (:attr:`Checkpoint.usable` False); None for a usable
    checkpoint or one without the mark."""
    if ckpt.usable:
        return None
    reason = ckpt.unusable_reason.strip()
    return Mark(reason.splitlines()[0] if reason else "", ckpt.probation)


def check_same_cluster(known: tuple[str, ...], hosts: list[str] | None, checkpoint) -> None:
    """A checkpoint whose hosts share none with this cluster's was fitted on another cluster: its
    predictions would all come from the "unknown" embeddings. That is an error (one line), not a
    silent fallback; a cluster that grew or shrank keeps some hosts and is fine."""
    if not hosts or not known or set(hosts) & set(known):
        return

    def names(xs) -> str:
        xs = sorted(set(xs))
        return ", ".join(xs[:3]) + (f" and {len(xs) - 3} more" if len(xs) > 3 else "")

    raise CheckpointError(
        f"{checkpoint} was fitted on another cluster (hosts {names(known)}; this one has "
        f"{names(hosts)}): fit on this cluster's traces, e.g. bdsgd fit --init {checkpoint}"
    )


def default_policy_specs(num_workers: int, with_checkpoint: bool) -> list[str]:
    """Every policy that applies to a cluster of ``num_workers``: full, a few static C (N-1,
    N-2, ~0.9N, ~0.75N), the dynamic cutoffs (bdsgd only with a checkpoint), the asynchronous
    variants with K ~ 0.75N, and the oracle."""
    n = num_workers
    statics = sorted({c for c in (n - 1, n - 2, round(0.9 * n), round(0.75 * n)) if 1 <= c < n})
    k = max(1, round(0.75 * n))
    dynamic = ["elfving", "ecdf", "ewma"] + (["bdsgd"] if with_checkpoint else [])
    asynchronous = [f"k-batch-sync:{k}", f"k-async:{k}", "async", "adasync"]
    return ["full", *(f"static:{c}" for c in reversed(statics)), *dynamic, *asynchronous, "oracle"]
