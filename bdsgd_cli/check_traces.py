"""``bdsgd check-traces DIR [--repair]``: find the trace files that make a store unreadable or
hold rows twice (one run's, or one job's under two run ids), say how many, and move them aside."""

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
    least one row, no run whose iterations lie far apart, and no row held twice: the same (run,
    iteration, worker) in two files, or one job's iterations under two run ids (a run resumed at
    iteration t > 0 repeating iterations the run it continues holds). Lists each bad file and
    why (for a repeat, both files and the rows; the later file is the bad one) and how many
    problems there are; exits 1 if bad files remain in the store (0 once --repair moved them
    aside). A moved file's rows that no other file holds stay in the store in a new file."""
    from bdsgd.stages.check_traces import CheckTracesConfig, check_traces

    result = check_traces(CheckTracesConfig(traces=traces, repair=repair))
    for path, why in result.bad.items():
        where = f" -> {result.moved[path]}" if path in result.moved else ""
        if path in result.kept:
            where += f" (its other rows stay in {result.kept[path].name})"
        click.echo(f"bad: {why}{where}", err=True)
    click.echo(summary(result, traces, repair))
    if json_out:
        emit_json({"files": result.files, "rows": result.rows, "problems": len(result.bad),
                   "bad": {str(k): v for k, v in result.bad.items()},
                   "copies": [copy_json(c) for c in result.copies],
                   "moved": {str(k): str(v) for k, v in result.moved.items()},
                   "kept": {str(k): str(v) for k, v in result.kept.items()}})  # fmt: skip
    if result.bad and not result.moved:
        sys.exit(EXIT_BAD_FILES)


def summary(result, traces: Path, repair: bool) -> str:
    """The one-line verdict: good files and rows, then how many problems of which kind."""
    good = result.files - len(result.bad)
    line = f"check-traces: {good} of {result.files} files good ({result.rows} rows)"
    if not result.bad:
        return f"{line}; no problems"
    counts = result.problem_counts()
    kinds = ", ".join(f"{n} {KINDS[kind]}" for kind, n in counts.items() if n)
    line += f"; {len(result.bad)} problem(s): {kinds}"
    if result.moved:
        return line + f"; {len(result.moved)} moved to {traces / QUARANTINE}"
    if repair:
        return line
    return line + f"; bdsgd check-traces {traces} --repair moves the bad ones aside"


KINDS = {
    "other_run": "repeating iterations of another run id",
    "same_run": "repeating rows of their run",
    "invalid": "unreadable, invalid or sparse",
}


def copy_json(copy) -> dict:
    return {"file": str(copy.file), "of_file": str(copy.of_file), "run_id": copy.run_id,
            "of_run_id": copy.of_run_id, "rows": copy.rows,
            "iterations": [copy.first_iteration, copy.last_iteration]}  # fmt: skip
