"""``bdsgd check-traces DIR [--repair]``: find the trace files that make a store unreadable and
move them aside."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from bdsgd_cli import options
from bdsgd_cli.common import emit_json, run_stage

EXIT_BAD_FILES = 1
QUARANTINE = (
    "quarantine"  # bdsgd.stages.check_traces's (not imported: the CLI loads without polars)
)


@click.command("check-traces")
@click.argument("traces", metavar="DIR", type=click.Path(path_type=Path))
@click.option(
    "--repair",
    is_flag=True,
    default=False,
    help=f"Move each bad file into DIR/{QUARANTINE}/, which readers skip (nothing is deleted).",
)
@options.json_out
@run_stage
def check_traces_cmd(traces: Path, repair: bool, json_out: bool) -> None:
    """Check every file of a trace store as fit and simulate read it: its schema and values, at
    least one row, no row that another file holds too, no run whose iterations lie far apart.
    Lists each bad file and why; exits 1 if bad files remain in the store (0 once --repair moved
    them aside)."""
    from bdsgd.stages.check_traces import CheckTracesConfig, check_traces

    result = check_traces(CheckTracesConfig(traces=traces, repair=repair))
    for path, why in result.bad.items():
        where = f" -> {result.moved[path]}" if path in result.moved else ""
        click.echo(f"bad: {why}{where}", err=True)
    good = result.files - len(result.bad)
    click.echo(f"check-traces: {good} of {result.files} files good ({result.rows} rows)"
               + (f", {len(result.moved)} moved to {traces / QUARANTINE}" if result.moved else "")
               + ("" if repair or not result.bad else f"; bdsgd check-traces {traces} --repair "
                  "moves the bad ones aside"))  # fmt: skip
    if json_out:
        emit_json({"files": result.files, "rows": result.rows,
                   "bad": {str(k): v for k, v in result.bad.items()},
                   "moved": {str(k): str(v) for k, v in result.moved.items()}})  # fmt: skip
    if result.bad and not result.moved:
        sys.exit(EXIT_BAD_FILES)
