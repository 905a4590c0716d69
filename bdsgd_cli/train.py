"""``bdsgd train``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
from click.core import ParameterSource

from bdsgd_cli import options
from bdsgd_cli.common import emit_json, run_stage

SPEC_KEYS = (
    "policy",
    "iterations",
    "wall_s",
    "throughput",
    "mean_c",
    "final_loss",
    "time_to_loss",
    "decision_ms_p50",
    "decision_ms_p99",
)


@click.command()
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    help="Number of worker processes N (required unless --resume).",
)
@click.option(
    "--iterations",
    type=click.IntRange(min=1),
    help="Iterations T (required unless --resume; with --resume: extend the run to T).",
)
@click.option(
    "--policy",
    help="Cutoff: full, static:C, elfving, ecdf, ewma, bdsgd (revises c as gradients arrive; "
    "bdsgd:fixed does not), with the suffixes simulate --policies lists (:goodput, "
    ":iteration, :online, :fixed, :unchecked); asynchronous: k-async:K, async, adasync[:G] "
    "(--iterations then counts updates). Required unless --resume.",
)
@click.option(
    "--traces",
    type=click.Path(file_okay=False),
    help="Trace store the rows are appended to (required unless --resume).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help="Run directory to write (required unless --resume).",
)
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="Fitted model (for bdsgd).")
@options.stragglers
@options.time_scale
@options.workload
@options.batch_size
@options.micro_batches
@options.device
@click.option(
    "--salvage/--no-salvage",
    default=True,
    show_default=True,
    help="A cut rank contributes the micro-batches it finished before the cut (see "
    "docs/policies.md for what this does to the estimator); --no-salvage: zeros.",
)
@click.option("--lr", type=float, default=0.05, show_default=True, help="Learning rate at c = N.")
@click.option(
    "--lr-scaling",
    type=click.Choice(["auto", "linear", "sqrt", "none", "adascale"]),
    default="auto",
    show_default=True,
    help="How the learning rate follows the share of the gradients applied: linear, sqrt, none, "
    "adascale (by their gain from the gradient noise scale, see docs/policies.md); auto: sqrt "
    "for an Adam-type optimizer (a workload's own), linear for SGD; adascale: asynchronous "
    "policies only.",
)
@options.seed
@click.option("--target-loss", type=float, help="Smoothed training loss that defines time_to_loss.")
@click.option(
    "--stop-at-target",
    is_flag=True,
    help="End the run once the smoothed training loss reaches --target-loss (summary.json's "
    "'stopped' says why a run ended).",
)
@click.option(
    "--max-wall-s",
    type=float,
    help="End the run once its wall clock passes this many seconds, whatever --iterations says "
    "(compare policies on the same time budget; a resumed run counts the time already spent).",
)
@click.option(
    "--min-workers",
    type=int,
    default=1,
    show_default=True,
    help="Asynchronous policies: fail when fewer workers than this are alive (a synchronous "
    "run ends when a rank dies).",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Synchronous policies on one machine: restart the job from its last checkpoint when a "
    "rank dies, at most this many times.",
)
@click.option(
    "--overhead-s",
    default="auto",
    show_default=True,
    help="Fixed cost per iteration given to the policy, seconds, or 'auto' to measure it (the "
    "asynchronous policies measure nothing: auto gives them 0).",
)
@options.explore
@click.option(
    "--resume",
    "resume",
    type=click.Path(file_okay=False, exists=True),
    help="Continue the killed run in this run directory, with the settings in its config.json "
    "(only --iterations, --workload, --allow-oversubscribe and --start-timeout may be given too; a "
    "module:function workload must be given again with --workload: the run directory is not "
    "trusted to name code).",
)
@options.host
@options.timeout
@options.start_timeout
@options.allow_oversubscribe
@click.option(
    "--force",
    is_flag=True,
    help="Start a new run in an --out that holds a previous run (its config, checkpoint, summary "
    "and iterations are removed once this run holds the directory's lock); an --out holding "
    "files bdsgd did not write is refused all the same.",
)
@options.json_out
@run_stage
def train(json_out: bool, resume: str | None, **kwargs) -> None:
    """Distributed SGD that drops stragglers: every rank trains and the first c gradients are
    summed in one all-reduce (cutoff policies, the library's loop), or a parameter server applies
    every K arrivals while stragglers keep computing (asynchronous policies); every observation
    (censored ones too) is appended to the traces."""
    if resume is None:
        check_new_run(kwargs)  # before torch is imported: a usage error is answered at once
    from bdsgd.stages.train import run_train

    cfg = _config(resume, kwargs)
    summary = run_train(cfg, resume=resume is not None)
    if json_out and summary is not None:  # None: a torchrun worker rank
        emit_json({k: summary[k] for k in SPEC_KEYS} | {"run_id": summary["run_id"]})


RESUME_FLAGS = {
    "resume",
    "iterations",
    "workload",
    "allow_oversubscribe",
    "start_timeout_s",
    "json_out",
}


def check_resume_flags(ctx: click.Context) -> None:
    """A resumed run takes its settings from its run directory: a flag that would be ignored
    is refused, so nobody believes a new --policy or --timeout took effect."""
    ignored = [
        param.opts[0]
        for param in ctx.command.params
        if param.name not in RESUME_FLAGS
        and ctx.get_parameter_source(param.name)
        in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    ]
    if ignored:
        from bdsgd.stages.errors import ConfigError

        raise ConfigError(
            f"--resume continues with the settings in RUN_DIR/config.json; only --iterations, "
            f"--workload, --allow-oversubscribe and --start-timeout may be given with it, not {', '.join(ignored)}"
        )


NEW_RUN_FLAGS = ("workers", "iterations", "policy", "traces", "out")


def check_new_run(kw: dict) -> None:
    """The flags a new run cannot start without, and its policy spec, checked without torch."""
    from bdsgd.stages.errors import ConfigError
    from bdsgd.stages.policy_names import check_spec

    missing = [f"--{k}" for k in NEW_RUN_FLAGS if kw[k] is None]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)} (or pass --resume RUN_DIR)")
    check_spec(kw["policy"], kw["workers"], has_model=kw["checkpoint"] is not None)


def _config(resume: str | None, kw: dict):
    from bdsgd.stages.errors import ConfigError
    from bdsgd.stages.train import TrainConfig, resume_config

    if resume:
        ctx = click.get_current_context()
        check_resume_flags(ctx)
        given = ctx.get_parameter_source("workload")
        workload = kw["workload"] if given == ParameterSource.COMMANDLINE else None
        cfg = resume_config(
            Path(resume), kw["iterations"], kw["allow_oversubscribe"], workload=workload
        )
        if ctx.get_parameter_source("start_timeout_s") == ParameterSource.COMMANDLINE:
            cfg = dataclasses.replace(cfg, start_timeout_s=kw["start_timeout_s"])  # (the machine's)
        return cfg
    overhead = kw.pop("overhead_s")
    try:
        kw["overhead_s"] = None if overhead == "auto" else float(overhead)
    except ValueError:
        raise ConfigError(
            f"--overhead-s must be a number of seconds or 'auto', got {overhead!r}"
        ) from None
    paths = {k: Path(kw[k]) if kw[k] else None for k in ("traces", "out", "checkpoint")}
    return TrainConfig(**{**kw, **paths})
