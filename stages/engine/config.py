"""The parameter server's config (built by the train stage from its own) and its two small pieces
of arithmetic: the optimizer and the learning-rate scaling."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.loop.config import LR_SCALINGS, lr_factor, lr_rule

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Settings of one engine run. Plain values only: it crosses the spawn boundary to every
    worker process unchanged (workers read what they need from it)."""

    workers: int
    iterations: int
    run_id: str
    source: str  # "profile" or "train": the trace rows' source
    device: str = "auto"  # auto | cpu (the parameter server computes on CPU)
    workload: str = "mlp"
    batch_size: int = 32
    micro_batches: int = 4
    stragglers: str = "none"
    time_scale: float = 1.0
    seed: int = 0
    lr: float = 0.05
    momentum: float = 0.9
    lr_scaling: str = "auto"  # auto (= linear: SGD) | linear | sqrt | none | adascale
    record_batch: int = 25  # trace rows and the checkpoint are written after every k-th iteration
    record_s: float = 2.0  # ... at most once per this many seconds (0: after every k-th)
    eval_every: int = 10
    min_workers: int = 1
    timeout_s: float = 60.0
    start_timeout_s: float = 300.0  # how long the workers may take to start (import torch, ...)
    host: str = "127.0.0.1"
    hosts: tuple[str, ...] = ()  # trace host of each worker (emulated hosts, or the machine)
    overhead_s: float | None = None  # None: measure it and feed it to the policy

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not (math.isfinite(self.start_timeout_s) and self.start_timeout_s > 0):
            raise ConfigError(f"--start-timeout must be a finite number of seconds > 0, "
                              f"got {self.start_timeout_s}")  # fmt: skip
        if self.lr_scaling not in LR_SCALINGS:
            raise ConfigError(f"--lr-scaling must be one of {', '.join(LR_SCALINGS)}")


def engine_config(stage_cfg, **values) -> EngineConfig:
    """An EngineConfig from a stage config: fields of the same name are copied (every stage
    config field named like an engine field means the same thing), ``values`` add the rest."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    stage = {f.name for f in dataclasses.fields(stage_cfg)}
    shared = {k: getattr(stage_cfg, k) for k in names & stage}
    return EngineConfig(**{**shared, **values})


def sgd(params, lr: float, momentum: float) -> torch.optim.SGD:
    """torch's SGD, fused where the parameters allow: the same arithmetic in fewer kernels."""
    params = list(params)
    try:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, fused=True)
    except RuntimeError:
        return torch.optim.SGD(params, lr=lr, momentum=momentum)


def scaled_lr(cfg: EngineConfig, n: float, live: int, gain: float | None = None) -> float:
    """The learning rate for a step on n gradients of ``live`` workers (``--lr-scaling``);
    ``adascale`` uses ``gain`` (the statistical gain of the n gradients relative to ``live``),
    and falls back to linear while no noise-scale estimate exists."""
    ratio = n / max(live, 1)
    if cfg.lr_scaling == "adascale":
        return cfg.lr * (gain if gain is not None else ratio)
    return cfg.lr * lr_factor(lr_rule(cfg.lr_scaling, "SGD"), ratio)  # (the server steps SGD)
