"""What one checkpoint of a training run costs as the run grows: the engine writes one every
``record_batch`` (25) iterations. Before the iteration log moved into segment files, each held the
whole log, so its cost grew with the run (and a run's total with its square)."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bdsgd.stages.engine.resume import STATE_FILE, Checkpointer
from bdsgd.stages.safe_load import save_atomic

ROW = dict(  # one iteration-log row as the engine writes it (every column a collective run has)
    policy="bdsgd", iteration=0, wall_s=1.5, workers=6, eval_loss=None, staleness=0.0,
    iteration_s=0.068, c=4, decision_ms=1.2, loss=0.41, chosen_c=4, start_s=1.43, busy_s=0.2,
    order=[3, 1, 0, 5], noise_scale=240.0, gain=3.1, lr=0.033, pred_q10=0.05, pred_q50=0.06,
    pred_q90=0.08, peer=None,
)  # fmt: skip


def log_of(rows: int) -> dict[str, list]:
    log: dict[str, list] = {k: [v] * rows for k, v in ROW.items()}
    log["order"] = [[(t + k) % 6 for k in range(4)] for t in range(rows)]  # one list per row
    log["wall_s"] = [0.07 * t for t in range(rows)]
    log["iteration"] = list(range(rows))
    return log


def seconds(save, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        save()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def checkpoint_costs(rows: int, repeats: int) -> tuple[float, float]:
    """(whole log, segmented) seconds of one checkpoint at ``rows`` iterations."""
    log = log_of(rows)
    state = {"version": 3, "next_iteration": rows, "log": log}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        whole = seconds(lambda: save_atomic(state, run_dir / STATE_FILE), repeats)
        ckpt = Checkpointer(run_dir)
        ckpt.save(state)  # the segments a run of this length has written on its way
        segmented = seconds(lambda: ckpt.save(state), repeats)
    return whole, segmented


def run(quick: bool = False) -> str:
    lines = [
        "## Checkpoint cost as a run grows (`stages/engine/checkpoint.py`)",
        "",
        "One checkpoint (the engine state without model parameters: the iteration log, 21 "
        "columns), median of 5 writes; a run writes one every 25 iterations. `python -c "
        '"from benchmarks.bench_checkpoint import run; print(run())"`.',
        "",
        "| iterations so far | whole log in the checkpoint (ms) | log in segments (ms) |",
        "|---|---|---|",
    ]
    for rows in (1_000, 10_000) if quick else (1_000, 10_000, 100_000):
        whole, segmented = checkpoint_costs(rows, 2 if quick else 5)
        lines.append(f"| {rows:,} | {whole * 1e3:.1f} | {segmented * 1e3:.1f} |")
    return "\n".join(lines)
