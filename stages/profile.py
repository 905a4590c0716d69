"""``bdsgd profile``: measure a real multi-process cluster into Parquet run-time traces.

The profile is a training run under policy ``full``: every worker's run-time of every iteration
is observed, none censored. It runs on the library's loop (``bdsgd.Cutoff``: every rank's compute
time measured before the collective, CUDA events on a GPU), the way a user's own job is profiled.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from pathlib import Path

import polars as pl
from bdsgd.stages.capacity import check_capacity
from bdsgd.stages.console import console
from bdsgd.stages.errors import BdsgdError, ConfigError
from bdsgd.stages.store import TraceStore, new_run_id
from bdsgd.stages.stragglers import parse_stragglers
from bdsgd.stages.wire.torchrun import Torchrun
from rich.table import Table


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    workers: int
    """Number of worker processes N."""
    iterations: int
    """Iterations T to measure."""
    traces: Path
    """Trace store directory the rows are appended to."""
    workload: str = "mlp"
    """mlp, cnn or module:function."""
    batch_size: int = 32
    """Mini-batch size per worker."""
    stragglers: str = "none"
    """none, synthetic[:k=v,...] or replay:PATH."""
    time_scale: float = 1.0
    """Multiplier on injected delays."""
    seed: int = 0
    """Seed of the workload, the data streams and the synthetic stragglers."""
    micro_batches: int = 4
    """Micro-batches per mini-batch (the points where a computation can be abandoned)."""
    device: str = "auto"
    """auto, cpu or cuda: where the ranks compute (cuda: one GPU per rank, NCCL)."""
    host: str = "127.0.0.1"
    """Address the control store and the server bind to."""
    timeout_s: float = 60.0
    """Longest wait on another process before it is declared dead."""
    start_timeout_s: float = 300.0
    """Longest wait for the workers to start (import torch, load the workload): on a loaded
    machine or a shared filesystem that takes far longer than any wait in a run."""
    allow_oversubscribe: bool = False
    """Start more workers than this machine runs (:mod:`bdsgd.stages.capacity`)."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        if self.iterations < 1:
            raise ConfigError(f"--iterations must be >= 1, got {self.iterations}")
        check_micro_batches(self.batch_size, self.micro_batches)
        for flag, value in (
            ("--timeout", self.timeout_s),
            ("--start-timeout", self.start_timeout_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{flag} must be a finite number of seconds > 0, got {value}")


@dataclass(frozen=True)
class ProfileResult:
    run_id: str
    rows: int
    traces: Path
    per_worker: pl.DataFrame


def check_micro_batches(batch_size: int, micro_batches: int) -> None:
    """One line naming the flag that is wrong: ``--micro-batches`` >= 1, ``--batch-size`` at
    least that many samples (each micro-batch holds one or more)."""
    if micro_batches < 1:
        raise ConfigError(f"--micro-batches must be >= 1, got {micro_batches}")
    if batch_size < micro_batches:
        raise ConfigError(
            f"--batch-size {batch_size} is smaller than --micro-batches {micro_batches}: each "
            "micro-batch needs at least one sample"
        )


def engine_hosts(stragglers: str, seed: int, time_scale: float, workers: int) -> tuple[str, ...]:
    """Trace host of each worker: the emulated host of a synthetic/replayed cluster, else this
    machine's name."""
    model = parse_stragglers(stragglers, seed, time_scale)
    return tuple(model.host_of(workers) or [socket.gethostname()] * workers)


def run_profile(cfg: ProfileConfig) -> ProfileResult | None:
    """Profile the cluster; under torchrun a worker rank only works and returns None."""
    tr = Torchrun.from_env()
    if tr is None:
        check_capacity(cfg.workers, cfg.allow_oversubscribe)
    return profile_loop(cfg, new_run_id("profile"), tr)


def profile_loop(cfg: ProfileConfig, run_id: str, tr) -> ProfileResult | None:
    """The profile on the library's loop (every rank measured by :class:`bdsgd.Cutoff`)."""
    from bdsgd.stages.loop_runs import profile_on_loop

    store = TraceStore(cfg.traces)
    undo_store = store.check_writable() if tr is None or tr.rank == 0 else None
    try:
        rows = profile_on_loop(cfg, run_id, tr)
    except (BdsgdError, KeyboardInterrupt):
        if undo_store:
            undo_store()
        raise
    if rows is None:
        return None
    per_worker = worker_summary(store, run_id)
    console.print(worker_table(per_worker, run_id))
    console.print(f"{rows} rows of run [bold]{run_id}[/] appended to {cfg.traces}")
    return ProfileResult(run_id, rows, cfg.traces, per_worker)


def worker_summary(store: TraceStore, run_id: str) -> pl.DataFrame:
    """Per worker: mean, p50 and p99 run-time, and the share of iterations it was the slowest."""
    df = store.scan().filter(pl.col("run_id") == run_id).collect()
    slowest = (
        df.sort("runtime_s", descending=True)
        .group_by("iteration")
        .agg(pl.col("worker").first())
        .group_by("worker")
        .agg((pl.len() / df["iteration"].n_unique()).alias("slowest_share"))
    )
    return (
        df.group_by("worker", "host")
        .agg(
            pl.col("runtime_s").mean().alias("mean_s"),
            pl.col("runtime_s").quantile(0.5).alias("p50_s"),
            pl.col("runtime_s").quantile(0.99).alias("p99_s"),
        )
        .join(slowest, on="worker", how="left")
        .with_columns(pl.col("slowest_share").fill_null(0.0))
        .sort("worker")
    )


def worker_table(per_worker: pl.DataFrame, run_id: str) -> Table:
    table = Table(title=f"run-times of {run_id}")
    for col in ("worker", "host", "mean ms", "p50 ms", "p99 ms", "slowest"):
        table.add_column(col, justify="right")
    for r in per_worker.iter_rows(named=True):
        table.add_row(
            str(r["worker"]),
            r["host"],
            f"{r['mean_s'] * 1e3:.1f}",
            f"{r['p50_s'] * 1e3:.1f}",
            f"{r['p99_s'] * 1e3:.1f}",
            f"{r['slowest_share']:.0%}",
        )
    return table
