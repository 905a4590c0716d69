"""``bdsgd simulate``."""

from __future__ import annotations

from pathlib import Path

import click

from bdsgd_cli import options
from bdsgd_cli.common import emit_json, run_stage

SPEC_KEYS = ("throughput", "oracle_ratio", "mean_c", "decision_ms")


@click.command()
@click.option(
    "--traces",
    type=click.Path(file_okay=False, exists=True),
    help="Trace store to replay (Parquet files, schema v1).",
)
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="Fitted model: adds bdsgd.")
@click.option(
    "--policies",
    default="",
    show_default=False,
    help="Comma-separated specs (full, static:C, elfving, ecdf, ewma, bdsgd, k-batch-sync:K, "
    "k-async:K, async, adasync, oracle; ecdf, ewma and bdsgd take ':iteration' for the "
    "per-iteration objective and ':online' or ':fixed' to revise c at every arrival or not; "
    "bdsgd is online by default; elfving, ecdf, ewma and bdsgd take ':goodput' to value c "
    "gradients by their gain, see --noise-scale; bdsgd:unchecked turns off its self-check "
    "against the simple peers); default: every policy that applies.",
)
@click.option(
    "--overhead-s",
    type=float,
    default=0.0,
    show_default=True,
    help="Fixed cost per iteration (per update for the async policies), seconds.",
)
@click.option("--out", type=click.Path(file_okay=False), help="Run directory to write.")
@click.option(
    "--run",
    "run_id",
    help="Run id to replay (default: the run that wrote the store's newest "
    "trace file, e.g. the last train run).",
)
@click.option(
    "--from-frac",
    type=float,
    default=0.0,
    show_default=True,
    help="Policies only observe this leading fraction of the run; the rest is simulated.",
)
@click.option(
    "--sample", type=int, help="Simulate T iterations drawn from --checkpoint's model instead."
)
@click.option(
    "--noise-scale",
    help="Gradient noise scale in samples, or a train run's iterations.parquet (or run "
    "directory) whose noise_scale column gives it by iteration: fed to the policies, and each "
    "cutoff policy reports goodput (gain(c) per second).",
)
@click.option(
    "--batch-size",
    type=int,
    help="Per-worker batch size the noise scale refers to [default: the train run's, or 32].",
)
@options.explore
@options.seed
@options.skip_bad_files
@options.json_out
@run_stage
def simulate(
    traces,
    checkpoint,
    policies,
    overhead_s,
    out,
    run_id,
    from_frac,
    sample,
    noise_scale,
    batch_size,
    explore,
    seed,
    skip_bad_files,
    json_out,
) -> None:
    """Replay recorded run-times (or the fitted model's own samples) through every cutoff and
    asynchronous policy, and rank them by throughput against the oracle."""
    from bdsgd.stages.policy_names import check_spec

    specs = tuple(p.strip() for p in policies.split(",") if p.strip())
    for spec in specs:  # before torch is imported: a typo is answered at once
        check_spec(spec, has_model=checkpoint is not None)
    from bdsgd.stages.simulate import SimulateConfig, run_simulate

    config = SimulateConfig(
        traces=Path(traces) if traces else None,
        checkpoint=Path(checkpoint) if checkpoint else None,
        policies=specs,
        overhead_s=overhead_s,
        out=Path(out) if out else None,
        run_id=run_id,
        from_frac=from_frac,
        sample=sample,
        noise_scale=noise_scale,
        batch_size=batch_size,
        explore=explore,
        seed=seed,
        skip_bad_files=skip_bad_files,
    )
    summary = run_simulate(config)
    print_ranking(summary)
    if json_out:
        emit_json(spec_json(summary))


def spec_json(summary: dict) -> dict:
    """SPEC's simulate object: the four metrics per policy first, then the extras."""
    policies = {
        name: {**{k: m[k] for k in SPEC_KEYS}, **{k: v for k, v in m.items() if k not in SPEC_KEYS}}
        for name, m in summary["policies"].items()
    }
    return {
        "workers": summary["workers"],
        "iterations": summary["iterations"],
        "policies": policies,
        "best": summary["best"],
        "best_async": summary["best_async"],
        **({"best_goodput": summary["best_goodput"]} if "best_goodput" in summary else {}),
    }


COLUMNS_EXPLAINED = (
    "[dim]grad/s: gradients applied per second; vs oracle: that over the oracle's on the same "
    "run-times; mean c: gradients applied per iteration; ms p50, ms p99: time to choose c, median "
    "and 99th percentile; idle: share of worker-seconds waiting or computing dropped gradients; "
    "stale: updates between a gradient's read and its application (asynchronous policies).[/]"
)


def print_ranking(summary: dict) -> None:
    """A rich table on stderr, best throughput (with --noise-scale: goodput) first, naming the
    best cutoff policy."""
    from bdsgd.stages.console import console
    from bdsgd.stages.policies.selfcheck import lean_message
    from rich import box
    from rich.table import Table

    title = f"{summary['workers']} workers, {summary['iterations']} iterations"
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    goodput = "best_goodput" in summary
    table.add_column("policy", no_wrap=True)
    first = ("goodput",) if goodput else ()
    for column in (*first, "grad/s", "vs oracle", "mean c", "ms p50", "ms p99", "idle", "stale"):
        table.add_column(column, justify="right", no_wrap=True)
    key = "goodput" if goodput else "throughput"
    ranked = sorted(summary["policies"].items(), key=lambda kv: -kv[1].get(key, float("-inf")))
    for name, m in ranked:
        table.add_row(
            name,
            *([f"{m['goodput']:.1f}" if "goodput" in m else "-"] if goodput else []),
            f"{m['throughput']:.1f}",
            f"{m['oracle_ratio']:.3f}",
            f"{m['mean_c']:.1f}",
            f"{m['decision_ms']:.3f}",
            f"{m['decision_ms_p99']:.3f}",
            f"{m['idle_fraction']:.0%}",
            f"{m['mean_staleness']:.1f}",
        )
    console.print(table)
    console.print(COLUMNS_EXPLAINED + (" goodput: gain(c) per second." if goodput else ""))
    console.print(f"best cutoff policy for this cluster: [bold]{summary['best']}[/bold]")
    if goodput:
        console.print(f"most progress per second (goodput): [bold]{summary['best_goodput']}[/bold]")
    if summary["best_async"]:
        console.print(f"best asynchronous or batch variant: {summary['best_async']}")
    for name, m in summary["policies"].items():
        if line := lean_message(name, m.get("self_check")):
            console.print(line)
