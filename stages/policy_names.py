"""The policy spec grammar (``--policy``, ``--policies``, ``Cutoff(policy=...)``), without torch.

:func:`check_spec` refuses every spec that :func:`bdsgd.stages.policies.registry.make_policy`
refuses, with the same one-line message, so that the CLI answers a typo before it imports torch,
Pyro or polars; the registry builds policies from specs this module accepts. This module imports
the standard library and :mod:`bdsgd.stages.errors` alone.
"""

from __future__ import annotations

from bdsgd.stages.errors import ConfigError

SPECS = (
    "full",
    "static:C",
    "elfving[:goodput]",
    "ecdf[:goodput][:OBJECTIVE][:STOPPING]",
    "ewma[:goodput][:OBJECTIVE][:STOPPING]",
    "bdsgd[:goodput][:OBJECTIVE][:STOPPING][:unchecked]",
    "k-batch-sync:K",
    "k-async:K",
    "async",
    "adasync[:GRADIENTS]",
    "oracle",
)
OBJECTIVES = ("long-run", "iteration")  # what a Monte Carlo cutoff maximises
STOPPING = ("online", "fixed")  # whether it revises c at every arrival
UNCHECKED = "unchecked"  # bdsgd without the self-check (bdsgd.stages.policies.selfcheck)
GOODPUT = "goodput"
MONTE_CARLO = ("ecdf", "ewma", "bdsgd")  # the policies that take an objective and a stopping rule
LEARNING = ("elfving", *MONTE_CARLO)  # the policies that --explore and :goodput apply to
COUNTED = ("static", "k-batch-sync", "k-async")  # a count 1..N after the colon
PLAIN = ("full", "oracle", "async")  # no colon
ASYNCHRONOUS = ("k-batch-sync", "k-async", "async", "adasync")
NEEDS_MODEL = (
    "policy 'bdsgd' needs a fitted model (checkpoint=... in the library, --checkpoint on the CLI)"
)


def kind_of(spec: str) -> str:
    """The policy's name: the spec up to its first colon (``ewma`` of ``ewma:iteration``)."""
    return spec.strip().partition(":")[0]


def check_spec(spec: str, num_workers: int | None = None, *, has_model: bool = True) -> None:
    """Raise :class:`ConfigError` (one line) unless ``spec`` names a policy for a cluster of
    ``num_workers`` (None: any size, the counts are checked against no upper bound);
    ``has_model`` False refuses ``bdsgd``, which needs a fitted model."""
    if num_workers is not None and num_workers < 1:
        raise ConfigError(f"need at least one worker, got {num_workers}")
    kind, colon, arg = spec.strip().partition(":")
    words = arg.split(":")
    if GOODPUT in words and kind not in LEARNING:
        raise ConfigError(
            f"policy {spec!r}: :goodput applies to the dynamic cutoff policies "
            f"({', '.join(LEARNING)}), not to {kind!r}"
        )
    if kind in PLAIN and not colon:
        return
    if kind in COUNTED:
        count(arg, spec, num_workers)
    elif kind == "adasync":
        if arg:
            count(arg, spec, None)
    elif kind == "elfving":
        elfving_goodput(arg, spec)
    elif kind in MONTE_CARLO:
        own = [w for w in words if w != UNCHECKED] if kind == "bdsgd" else words
        monte_carlo_options(":".join(own), spec, kind)
        if kind == "bdsgd" and not has_model:
            raise ConfigError(NEEDS_MODEL)
    else:
        raise unknown(spec)


def count(arg: str, spec: str, limit: int | None) -> int:
    """The integer after the colon, 1 <= value <= limit."""
    try:
        value = int(arg)
    except ValueError:
        raise ConfigError(f"policy {spec!r} needs a whole number after ':'") from None
    if value < 1 or (limit is not None and value > limit):
        bound = f"1..{limit}" if limit is not None else ">= 1"
        raise ConfigError(f"policy {spec!r}: the number must be in {bound}")
    return value


def monte_carlo_options(arg: str, spec: str, kind: str) -> dict:
    """``goodput``, the objective and the stopping rule after the colons of
    ``ecdf``/``ewma``/``bdsgd``, in any order (defaults: throughput, ``long-run``; ``online`` for
    bdsgd, ``fixed`` for the others)."""
    options: dict = {"objective": "long-run", "stopping": "online" if kind == "bdsgd" else "fixed"}
    given: set[str] = set()
    for word in filter(None, arg.split(":")):
        key = "objective" if word in OBJECTIVES else "stopping" if word in STOPPING else None
        key = GOODPUT if word == GOODPUT else key
        if key is None or key in given:
            raise ConfigError(
                f"policy {spec!r}: options are {GOODPUT}, an objective ({', '.join(OBJECTIVES)}) "
                f"and a stopping rule ({', '.join(STOPPING)}), at most one of each"
            )
        options[key] = True if key == GOODPUT else word
        given.add(key)
    return options


def elfving_goodput(arg: str, spec: str) -> bool:
    """``elfving`` takes one option, ``goodput``."""
    if arg not in ("", GOODPUT):
        raise unknown(spec)
    return arg == GOODPUT


def unknown(spec: str) -> ConfigError:
    return ConfigError(f"unknown policy {spec!r} (known: {', '.join(SPECS)})")
