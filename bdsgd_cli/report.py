"""``bdsgd report RUN_DIR... --out DIR``: plots and a Markdown index of what happened."""

from __future__ import annotations

from pathlib import Path

import click

from bdsgd_cli import options
from bdsgd_cli.common import emit_json, run_stage


@click.command("report")
@click.argument(
    "run_dirs",
    nargs=-1,
    required=True,
    metavar="RUN_DIR...",
    type=click.Path(exists=True, path_type=Path),
)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for the PNG plots and index.md: new (created), empty, or an earlier "
    "report's (replaced; a directory holding other files is refused).",
)
@click.option(
    "--rolling-window",
    type=int,
    default=20,
    show_default=True,
    help="Iterations in the rolling throughput window.",
)
@options.json_out
@run_stage
def report(run_dirs: tuple[Path, ...], out: Path, rolling_window: int, json_out: bool) -> None:
    """Plot what happened in run directories (written by `train --out`, `simulate --out`).

    Several runs are overlaid, one curve per policy: the cutoff c over iterations, iteration time
    and throughput over wall-clock time, loss vs time, a worker x iteration run-time heatmap with
    the cut-off workers marked, run-time CDFs, predicted vs observed iteration time and the time
    spent choosing c. Writes OUT/index.md with every plot and the metrics of every run.
    """
    from bdsgd.stages.report import ReportConfig, run_report

    config = ReportConfig(run_dirs=run_dirs, out=out, rolling_window=rolling_window)
    result = run_report(config)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"report: {result.index} ({len(result.plots)} plots)")
    if json_out:
        emit_json({"index": str(result.index), "plots": [str(p) for p in result.plots]})
