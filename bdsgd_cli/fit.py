"""``bdsgd fit``."""

from __future__ import annotations

from pathlib import Path

import click

from bdsgd_cli import options
from bdsgd_cli.common import emit_json, run_stage

AUTO_HOST_KS = 0.05  # bdsgd.stages.fit's (imported late, with torch)
SCORED = (("runtime", "run-times"), ("order_stat", "x_(c)"))


class StepsType(click.ParamType):
    """``--steps``: a positive integer, or ``auto`` (None: ``FitConfig.steps``'s default)."""

    name = "INTEGER|auto"

    def convert(self, value, param, ctx):
        if value is None or value == "auto":
            return None
        try:
            steps = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither a whole number nor auto", param, ctx)
        return steps  # (FitConfig checks that it is at least 1)


"""The calibration's two scores, as the lines below name them."""


@click.command()
@options.existing_traces
@click.option(
    "--checkpoint",
    required=True,
    type=click.Path(dir_okay=False),
    help="Where to write the fitted model (one file, written atomically): a new path, or an "
    "earlier bdsgd checkpoint, which it replaces; never inside --traces.",
)
@click.option(
    "--steps",
    type=StepsType(),
    default="auto",
    show_default=True,
    help="Most SVI steps; auto: about 9 per square root of the run-times trained on, from 400 "
    "(up to a few thousand run-times) to 2000 (about 50,000 and more).",
)
@click.option(
    "--early-stop/--no-early-stop",
    default=True,
    show_default=True,
    help="Stop when the ELBO of the first half of the held-out part stops improving, and keep "
    "the weights of its best check (where that part holds at least 1,000 run-times).",
)
@options.seed
@click.option(
    "--init",
    type=click.Path(dir_okay=False),
    default=None,
    help="Continue from this earlier checkpoint.",
)
@click.option(
    "--window", type=int, default=48, show_default=True, help="Iterations per training window."
)
@click.option("--batch", type=int, default=16, show_default=True, help="Windows per SVI step.")
@click.option("--lr", type=float, default=3e-3, show_default=True, help="Initial learning rate.")
@click.option(
    "--step-workers",
    type=int,
    default=None,
    help="Workers each SVI step sees, as whole hosts drawn at random (0: every worker). "
    "Default: on 512 workers and more, 64 or 4 hosts' worth if more, where that is at most a "
    "quarter of the workers (16 hosts and more); every worker otherwise.",
)
@click.option(
    "--host-drops",
    is_flag=True,
    default=False,
    help="Model a host's slow spell ending (a drop of the whole host) as well as starting: "
    "better held-out NLL on hosts that switch in and out of slow spells, a little less "
    "throughput where hosts slow down gradually, a dearer decision at 1,024 workers "
    "(docs/decisions.md). With --init, the earlier checkpoint's choice stands. Without it, "
    "fit may still turn it on (--auto-host-ks).",
)
@click.option(
    "--host-regime",
    is_flag=True,
    default=False,
    help="Filter each host's slow spells as a two-state chain and give the model what it says: "
    "better held-out NLL and run-time calibration on hosts that switch in and out of slow "
    "spells, a little less throughput where hosts slow down gradually. With --init from a "
    "checkpoint without it, its weights start at 0; one with it keeps it. Without it, fit may "
    "still turn it on (--auto-host-ks).",
)
@click.option(
    "--auto-host-ks",
    type=float,
    default=AUTO_HOST_KS,
    show_default=True,
    help="Without --host-drops, --host-regime and --init: when the held-out run-times' PIT KS "
    "distance is above this (the predictive's shape is off), fit again with --host-drops "
    "--host-regime and keep that fit if its KS is lower (the fit takes about twice as long). "
    "1: never.",
)
@click.option(
    "--holdout",
    type=float,
    default=0.2,
    show_default=True,
    help="Share of each run's last iterations held out for val_nll (0: none).",
)
@click.option(
    "--threads", type=int, default=1, show_default=True, help="torch CPU threads while fitting."
)
@click.option(
    "--no-progress",
    "progress",
    flag_value=False,
    default=True,
    show_default=False,
    help="No progress bar on stderr.",
)
@options.skip_bad_files
@options.json_out
@run_stage
def fit(json_out: bool, traces: str, checkpoint: str, init: str | None, **kwargs) -> None:
    """Train the deep generative run-time model on a trace store and save a checkpoint."""
    from bdsgd.stages.fit import FitConfig, run_fit

    result = run_fit(
        FitConfig(
            traces=Path(traces),
            checkpoint=Path(checkpoint),
            init=Path(init) if init else None,
            **kwargs,
        )
    )
    _print_table(result)
    if json_out:
        emit_json(result.to_json())


def _print_table(result) -> None:
    """The held-out NLL of the model and the baselines, on stderr (stdout stays for --json)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    if result.step_workers:
        console.print(f"each step saw about {result.step_workers} workers (--step-workers)")
    if result.host_drops or result.host_regime:
        chosen = [name for name, on in (("host drops", result.host_drops),
                                        ("the host regime", result.host_regime)) if on]  # fmt: skip
        console.print(f"the model has {' and '.join(chosen)}")
    stopped = result.steps < result.planned_steps
    console.print(
        f"fitted {result.steps} of {result.planned_steps} steps"
        + (" (stopped early: the held-out ELBO stopped improving)" if stopped else "")
    )
    if result.val_nll is None:
        console.print(f"checkpoint: {result.checkpoint} (no held-out data)")
        return
    table = Table(title="held-out NLL (nats/run-time)")
    table.add_column("predictor")
    table.add_column("nll", justify="right")
    for name, nll in (("model", result.val_nll), *result.baseline_nll.items()):
        table.add_row(name, f"{nll:.4f}")
    console.print(table)
    for line in (_calibration_line(result.calibration), _ks_line(result.calibration)):
        if line:
            console.print(line)
    console.print(f"checkpoint: {result.checkpoint}  ({result.fit_s:.1f} s)")


def _calibration_line(calibration: dict | None) -> str | None:
    """How often the held-out values fell inside the model's central 90% predictive interval,
    with a warning outside 85-95% (a predictive too sure or too vague where policies cut)."""
    if not calibration or calibration["runtime"]["coverage"] is None:
        return None
    parts = []
    for key, label in SCORED:
        cover = calibration[key]["coverage"]
        if cover is not None:
            warn = "" if 0.85 <= cover <= 0.95 else " [yellow](outside 85-95%)[/]"
            parts.append(f"{label} {cover:.1%}{warn}")
    return (
        "held-out inside the central 90% predictive interval: " + ", ".join(parts) + "\n"
        "[dim](x_(c): the c-th fastest run-time of an iteration, when a cutoff policy's iteration "
        "ends, at the c it would choose; 85-95% is well calibrated, below: the predictive is too "
        "sure, above: too vague)[/]"
    )


def _ks_line(calibration: dict | None) -> str | None:
    """The PITs' KS distance from uniform (the predictive's shape, not only its 90% interval),
    flagged where it is above 0.05 and above what a calibrated predictive stays under in 95% of
    samples of as many values (``ks_p95``: over a few values 0.05 is noise)."""
    if not calibration:
        return None
    parts = []
    for key, label in SCORED:
        scores = calibration.get(key) or {}
        ks = scores.get("ks")
        if ks is not None:
            off = ks > max(AUTO_HOST_KS, scores.get("ks_p95") or 0.0)
            parts.append(f"{label} {ks:.3f}" + (" [yellow](off)[/]" if off else ""))
    return (
        "held-out PIT KS (0: the predictive's shape fits): " + ", ".join(parts) if parts else None
    )
