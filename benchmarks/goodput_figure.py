"""The goodput figure and table of docs/policies.md, from ``bdsgd simulate --noise-scale``.

A synthetic cluster (``SyntheticCluster``, seed 0, 16 workers, 1600 iterations): ``fit`` (default
steps) learns the run-time model on the first half, and the second half is replayed
(``--from-frac 0.5``, as ``bench_heldout`` does) with a noise-scale schedule written as a train run
would log it (``iterations.parquet`` with a ``noise_scale`` column, per-worker batch 32). Over the
replayed 800 iterations the noise scale grows geometrically from 8 to 20,000 samples, as it does
when the loss falls (McCandlish et al. 2018): early on gradients agree (B is a quarter of one
worker's batch), late noise dominates (B is 40 times the 16 workers' batch). Every cutoff policy
ranks by goodput; ``report`` draws c over the noise scale for ``bdsgd`` and ``bdsgd:goodput``.

Reproduce: ``.venv/bin/python -m benchmarks.goodput_figure docs/goodput.png``
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from bdsgd.schemas.run_dir import iterations_table, write_run_dir
from bdsgd.stages.fit import FitConfig, run_fit
from bdsgd.stages.report import ReportConfig, run_report
from bdsgd.stages.simulate import SimulateConfig, run_simulate
from bdsgd.stages.store import RunMatrix, TraceStore, matrix_rows
from bdsgd.stages.stragglers import SyntheticCluster

WORKERS, ITERATIONS, BATCH = 16, 1600, 32
FROM_FRAC = 0.5
NOISE_FIRST, NOISE_LAST = 8.0, 20_000.0
RANKED = (
    "full",
    "static:14",
    "static:12",
    "elfving",
    "elfving:goodput",
    "ecdf",
    "ecdf:goodput",
    "ewma",
    "ewma:goodput",
    "bdsgd",
    "bdsgd:goodput",
)
DRAWN = ("bdsgd", "bdsgd:goodput")


def write_cluster(store: Path) -> None:
    cluster = SyntheticCluster(seed=0)
    runtimes = cluster.delays(ITERATIONS, WORKERS)
    full = np.ones(runtimes.shape, dtype=bool)
    run = RunMatrix("synthetic", runtimes, ~full, full, tuple(cluster.host_of(WORKERS)))
    TraceStore(store).append(matrix_rows(run))


def write_schedule(run_dir: Path) -> None:
    """A run directory whose noise_scale rises geometrically, as a train run would log it."""
    t = np.arange(ITERATIONS)
    start = int(FROM_FRAC * ITERATIONS)  # the warm-up rows are only observed: no noise needed
    rise = np.clip((t - start) / (ITERATIONS - 1 - start), 0.0, 1.0)
    noise = NOISE_FIRST * (NOISE_LAST / NOISE_FIRST) ** rise
    columns = {
        "policy": ["schedule"] * ITERATIONS,
        "iteration": t.tolist(),
        "wall_s": t.astype(float).tolist(),
        "iteration_s": [1.0] * ITERATIONS,
        "c": [WORKERS] * ITERATIONS,
        "workers": [WORKERS] * ITERATIONS,
        "decision_ms": [0.0] * ITERATIONS,
        "noise_scale": noise.tolist(),
    }
    write_run_dir(run_dir, {"kind": "train"}, iterations_table(columns))
    (run_dir / "config.json").write_text(f'{{"batch_size": {BATCH}}}')


def table(summary: dict) -> str:
    rows = sorted(summary["policies"].items(), key=lambda kv: -kv[1]["goodput"])
    lines = [
        "| policy | goodput | throughput | mean_c |",
        "|---|---|---|---|",
    ]
    for name, m in rows:
        lines.append(f"| {name} | {m['goodput']:.1f} | {m['throughput']:.1f} | {m['mean_c']:.1f} |")
    return "\n".join(lines)


def main(png: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_cluster(root / "traces")
        write_schedule(root / "schedule")
        model = root / "model.pt"
        run_fit(FitConfig(traces=root / "traces", checkpoint=model, holdout=FROM_FRAC))
        common = dict(
            traces=root / "traces",
            checkpoint=model,
            from_frac=FROM_FRAC,
            noise_scale=str(root / "schedule"),
        )
        summary = run_simulate(SimulateConfig(policies=RANKED, **common))
        run_simulate(SimulateConfig(policies=DRAWN, out=root / "sim", **common))
        report = run_report(ReportConfig(run_dirs=(root / "sim",), out=root / "report"))
        drawn = next(p for p in report.plots if p.name == "noise_scale.png")
        shutil.copyfile(drawn, png)
    print(table(summary))
    print(
        f"best cutoff policy by throughput: {summary['best']}; by goodput: "
        f"{summary['best_goodput']}"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/goodput.png"))
