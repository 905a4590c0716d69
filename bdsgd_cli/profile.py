"""``bdsgd profile``."""

from __future__ import annotations

from pathlib import Path

import click

from bdsgd_cli import options
from bdsgd_cli.common import emit_json, run_stage


@click.command()
@options.workers
@options.iterations
@options.traces
@options.workload
@options.batch_size
@options.stragglers
@options.time_scale
@options.seed
@options.micro_batches
@options.device
@options.host
@options.timeout
@options.start_timeout
@options.allow_oversubscribe
@options.json_out
@run_stage
def profile(json_out: bool, traces: str, **kwargs) -> None:
    """Measure N real worker processes into Parquet run-time traces (fully synchronous)."""
    from bdsgd.stages.profile import ProfileConfig, run_profile

    result = run_profile(ProfileConfig(traces=Path(traces), **kwargs))
    if json_out and result is not None:  # None: a torchrun worker rank
        emit_json({"run_id": result.run_id, "rows": result.rows, "traces": str(result.traces)})
