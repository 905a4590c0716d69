"""The options of a cutoff-controlled training loop (:class:`~bdsgd.stages.loop.rank.Cutoff`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from numbers import Integral, Real
from pathlib import Path

from bdsgd.stages.errors import ConfigError

LR_SCALINGS = ("auto", "linear", "sqrt", "none", "adascale")
MAX_ITERATIONS = 1 << 31  # the length of a rank's column of injected delays
ADAM_FAMILY = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adafactor", "Adagrad", "RMSprop")


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """What :class:`~bdsgd.stages.loop.rank.Cutoff` takes; every field has a sensible default."""

    policy: str = "full"
    """Cutoff policy (SPEC names: ``full``, ``static:C``, ``elfving``, ``ecdf``, ``ewma``,
    ``bdsgd``, ``bdsgd:fixed``, ...). ``full`` cuts nothing and only measures."""
    checkpoint: str | os.PathLike | None = None
    """Fitted run-time model (``bdsgd fit``), needed by ``bdsgd`` policies."""
    traces: str | os.PathLike | None = None
    """Trace store (schema v1) the run appends its rows to; None writes none."""
    out: str | os.PathLike | None = None
    """Run directory (summary.json, iterations.parquet, checkpoint.pt) that ``bdsgd report``
    reads; None writes none."""
    micro_batches: int = 1
    """Parts :meth:`Iteration.micro_batches` splits a rank's batch into: the places where a
    rank that is cut stops."""
    salvage: bool = True
    """A cut rank contributes the micro-batches it finished (DropCompute's rule); False: zeros.
    On by default: the finished work is free, and it keeps the loss per step near plain DDP's
    (docs/benchmarks.md, "bdsgd in a user's loop")."""
    lr_scaling: str = "auto"
    """How :meth:`Cutoff.step` scales the optimizer's learning rate by the admitted share f of
    the nominal samples: ``linear`` (lr * f), ``sqrt`` (lr * sqrt f), ``none``, ``adascale``
    (lr * gain(c) / gain(N) from the gradient noise scale, :mod:`bdsgd.stages.goodput`);
    ``auto`` is ``sqrt`` for Adam-type optimizers and ``linear`` for SGD-type ones."""
    stragglers: str = "none"
    """Injected delays (``none``, ``synthetic[:k=v,...]``, ``replay:PATH``), as ``bdsgd train
    --stragglers``: each rank waits out its delay spread over its micro-batches, and a cut ends
    the wait."""
    time_scale: float = 1.0
    """Multiplies every injected delay."""
    seed: int = 0
    """Seed of the injected delays and of the policy's random stream."""
    run_id: str | None = None
    """The run's id in the traces; None: a new one."""
    coordinator_rank: int = 0
    """The training rank whose process runs the coordinator thread."""
    cut_relay: bool | None = None
    """Relay the cut per node (:mod:`~bdsgd.stages.loop.relay`): the node's first rank waits for
    it on the job's store and the node's ranks look in a store on loopback. None: when the job
    spans several hosts and a host runs several ranks."""
    timeout_s: float = 300.0
    """Longest wait on the other ranks or the coordinator, seconds."""
    record_every: int = 50
    """Trace rows are written after every this many iterations (and at each save and at
    close)."""
    target_loss: float | None = None
    """The summary's ``time_to_loss``: wall-clock seconds until the smoothed training loss
    first reaches it."""
    workload: str = "user"
    """The trace rows' ``workload`` column."""
    batch_size: int | None = None
    """The trace rows' ``batch_size`` column: samples of one rank's mini-batch (None: null)."""
    overhead_s: float | None = None
    """A fixed cost per iteration the policy adds to the wait (``bdsgd train --overhead-s``);
    None measures it while running: the iteration's time beyond its c-th arrival, smoothed."""
    explore: float = 0.0
    """Share of iterations in which a learning policy waits for every rank (uncensored
    observations of the tail)."""
    check_every: int = 100
    """Every this many iterations the ranks compare a checksum of their parameters in the
    all-reduce; ranks that differ end the run with one line (0: never)."""
    broadcast_buffers: bool = True
    """After every all-reduce every rank's buffers (BatchNorm's running statistics) take rank
    0's values, as DDP's ``broadcast_buffers``: identical parameters and buffers on every rank
    after every step. False: each rank keeps its own."""

    def __post_init__(self) -> None:
        for field in fields(self):
            check_type(field.name, getattr(self, field.name), field.type)
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be at least 1, got {self.micro_batches}")
        if self.lr_scaling not in LR_SCALINGS:
            raise ConfigError(f"lr_scaling must be one of {', '.join(LR_SCALINGS)}")
        for name in ("timeout_s", "time_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value}")
        if self.overhead_s is not None and not (
            math.isfinite(self.overhead_s) and self.overhead_s >= 0
        ):
            raise ConfigError(f"overhead_s must be a finite number >= 0, got {self.overhead_s}")
        if not 0.0 <= self.explore < 1.0:
            raise ConfigError(f"explore must be in [0, 1), got {self.explore}")
        if self.check_every < 0:
            raise ConfigError(f"check_every must be >= 0, got {self.check_every}")
        if self.record_every < 1:
            raise ConfigError(f"record_every must be at least 1, got {self.record_every}")
        if self.coordinator_rank < 0:
            raise ConfigError(f"coordinator_rank must be >= 0, got {self.coordinator_rank}")
        if self.policy.split(":")[0] in ("async", "k-async", "k-batch-sync", "adasync"):
            raise ConfigError(
                f"policy {self.policy!r} is asynchronous: a training loop takes synchronous "
                "cutoff policies (full, static:C, elfving, ecdf, ewma, bdsgd, ...)"
            )

    @property
    def out_path(self) -> Path | None:
        return None if self.out is None else Path(self.out)


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


# each field's annotation: whether a value fits it, and what it takes (the error's words)
KINDS = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "str | None": (lambda v: v is None or isinstance(v, str), "a string or None"),
    "str | os.PathLike | None": (
        lambda v: v is None or isinstance(v, str | os.PathLike),
        "a path or None",
    ),
    "int": (_is_int, "an integer"),
    "int | None": (lambda v: v is None or _is_int(v), "an integer or None"),
    "float": (_is_number, "a number"),
    "float | None": (lambda v: v is None or _is_number(v), "a number or None"),
    "bool": (lambda v: isinstance(v, bool), "True or False"),
    "bool | None": (lambda v: v is None or isinstance(v, bool), "True, False or None"),
}


def check_type(name: str, value, annotation: str) -> None:
    """A one-line ConfigError unless ``value`` fits the field's annotation (before the checks of
    its value, which would fail on another type with an error of their own)."""
    fits, takes = KINDS[annotation]
    if not fits(value):
        raise ConfigError(f"{name} must be {takes}, got {value!r} ({type(value).__name__})")


def source_of(policy: str) -> str:
    """The trace rows' ``source``: a run that only measures (``full``) is a profile."""
    return "profile" if policy == "full" else "train"


def lr_rule(scaling: str, optimizer_name: str) -> str:
    """The rule ``auto`` stands for with an optimizer of this class name."""
    if scaling != "auto":
        return scaling
    return "sqrt" if optimizer_name in ADAM_FAMILY else "linear"


def lr_factor(rule: str, share: float) -> float:
    """The learning-rate multiplier for an admitted share ``share`` of the nominal samples."""
    share = min(max(share, 0.0), 1.0)
    return {"linear": share, "sqrt": math.sqrt(share), "none": 1.0}[rule]


def _stragglers(cfg: LoopConfig, world: int, rank: int):
    """This rank's column of injected delays (None: none) and the emulated hosts of the
    straggler model (None: the machines' own names)."""
    if cfg.stragglers == "none":
        return None, None
    from bdsgd.stages.stragglers import parse_stragglers

    model = parse_stragglers(cfg.stragglers, seed=cfg.seed, time_scale=cfg.time_scale)
    return model.column(MAX_ITERATIONS, world, rank), model.host_of(world)


def straggler_delays(spec: str, world: int, rank: int, seed: int = 0, time_scale: float = 1.0):
    """Rank ``rank``'s injected delays of a ``--stragglers`` spec (``.at(step)``, seconds), or
    None for ``none``: what :class:`Cutoff` waits out, for a script without bdsgd that is to
    meet the same emulated cluster."""
    cfg = LoopConfig(stragglers=spec, seed=seed, time_scale=time_scale)
    return _stragglers(cfg, world, rank)[0]
