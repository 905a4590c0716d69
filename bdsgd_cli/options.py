"""click options used by more than one command, so their names and help stay identical."""

from __future__ import annotations

import click


def _traces(exists: bool):
    return click.option(
        "--traces",
        "traces",
        required=True,
        type=click.Path(file_okay=False, exists=exists),
        help="Trace store directory (Parquet files, schema v1).",
    )


traces = _traces(exists=False)  # a store the command may create (profile, import)
existing_traces = _traces(exists=True)  # a store the command reads (fit)
seed = click.option("--seed", type=int, default=0, show_default=True, help="Random seed.")
json_out = click.option(
    "--json", "json_out", is_flag=True, help="Print a JSON summary as the last line of stdout."
)
workers = click.option(
    "--workers", type=click.IntRange(min=1), required=True, help="Number of worker processes N."
)
iterations = click.option(
    "--iterations", type=click.IntRange(min=1), required=True, help="Iterations T to run."
)
stragglers = click.option(
    "--stragglers",
    default="none",
    show_default=True,
    help="Injected stragglers: none, synthetic[:k=v,...], replay:PATH (see docs/stragglers.md).",
)
time_scale = click.option(
    "--time-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Multiply injected delays by this factor (shrinks a replayed cluster's seconds).",
)
workload = click.option(
    "--workload",
    default="mlp",
    show_default=True,
    help="Built-in workload (mlp, cnn, transformer) or module:function returning a Workload.",
)
batch_size = click.option(
    "--batch-size", type=int, default=32, show_default=True, help="Mini-batch size per worker."
)
micro_batches = click.option(
    "--micro-batches",
    type=int,
    default=4,
    show_default=True,
    help="Micro-batches per mini-batch: where a cut-off computation can stop.",
)
host = click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address the server binds to (loopback unless you name one; 0.0.0.0: the control "
    "store listens on every interface, the workers reach it and bind gloo on loopback).",
)
timeout = click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds to wait on another process before declaring it dead.",
)
start_timeout = click.option(
    "--start-timeout",
    "start_timeout_s",
    type=float,
    default=300.0,
    show_default=True,
    help="Seconds the workers may take to start (import torch, load the workload) before the "
    "run fails naming the ones that did not.",
)

explore = click.option(
    "--explore",
    type=float,
    default=0.0,
    show_default=True,
    help="Fraction of iterations in which the learning cutoff policies (elfving, ecdf, ewma, "
    "bdsgd) wait for every worker, so that the slow tail is observed uncensored.",
)
allow_oversubscribe = click.option(
    "--allow-oversubscribe",
    is_flag=True,
    help="Start more worker processes than this machine's cores and memory run (refused "
    "otherwise, before any process starts).",
)


def auto_choice(name: str, others: list[str], help: str):
    """A setting chosen among ``auto`` (the default) and ``others`` (the values are
    written out here, not imported from the stages' configs: the CLI loads without torch)."""
    return click.option(
        name, type=click.Choice(["auto", *others]), default="auto", show_default=True, help=help
    )


device = auto_choice(
    "--device",
    ["cpu", "cuda"],
    "Where the ranks compute: each takes its own GPU (LOCAL_RANK) and NCCL when there are "
    "enough, gloo on CPU otherwise; auto: cuda when a GPU is visible.",
)
skip_bad_files = click.option(
    "--skip-bad-files",
    is_flag=True,
    default=False,
    help="Leave out trace files that are unreadable, not valid schema v1, hold no row, repeat "
    "rows of an earlier file or hold an iteration far beyond their run's others (each is named "
    "on stderr) instead of refusing the store; no file is modified (bdsgd check-traces DIR "
    "--repair moves them aside).",
)
