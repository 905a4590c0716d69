"""``bdsgd import FILE --traces DIR``: add a run-time log from another tool to a trace store."""

from __future__ import annotations

import click

from bdsgd_cli import options
from bdsgd_cli.common import emit_json, run_stage

FORMATS = ("auto", "csv", "parquet")  # bdsgd.stages.importer's (the CLI loads without polars)


def _col(flag: str, default: str | None, what: str) -> click.Option:
    shown = f"Column holding {what}."
    return click.option(flag, default=default, show_default=bool(default), help=shown)


@click.command("import")
@click.argument("file", type=click.Path(dir_okay=False))
@options.traces
@_col("--iteration-col", "iteration", "the 0-based iteration")
@_col("--worker-col", "worker", "the worker id (rank, sparse id or name)")
@_col("--runtime-col", "runtime_s", "the run-time in seconds")
@_col("--run-col", None, "the run id; default: run_id if present")
@_col("--host-col", None, "the host; default: host if present, else 'unknown'")
@_col("--censored-col", None, "censoring flags; default: censored if present, else false")
@_col("--start-col", None, "start times; default: start_s if present, else cumulative run-times")
@_col("--world-size-col", None, "world sizes; default: world_size if present, else max rank + 1")
@click.option("--run-id", default=None, help="Run id for a log without a run column.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="auto",
    show_default=True,
    help="Input format; auto: Parquet for .parquet/.pq, CSV otherwise.",
)
@options.json_out
@run_stage
def import_cmd(
    file,
    traces,
    iteration_col,
    worker_col,
    runtime_col,
    run_col,
    host_col,
    censored_col,
    start_col,
    world_size_col,
    run_id,
    fmt,
    json_out,
):
    """Import FILE (CSV or Parquet, one row per iteration and worker) into the trace store."""
    from bdsgd.stages.importer import ImportConfig, run_import

    config = ImportConfig(
        path=file,
        traces=traces,
        iteration_col=iteration_col,
        worker_col=worker_col,
        runtime_col=runtime_col,
        run_col=run_col,
        host_col=host_col,
        censored_col=censored_col,
        start_col=start_col,
        world_size_col=world_size_col,
        run_id=run_id,
        format=fmt,
    )
    result = run_import(config)
    if json_out:
        emit_json(
            {
                "rows": result.rows,
                "runs": result.runs,
                "traces": str(result.traces),
                "files": [str(f) for f in result.files],
            }
        )
        return
    from rich.console import Console

    Console().print(
        f"imported {result.rows} rows, {len(result.runs)} run(s) "
        f"({', '.join(result.runs)}) into {result.traces}",
        soft_wrap=True,
        highlight=False,
    )
