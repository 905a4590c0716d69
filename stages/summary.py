"""The one summary of a training run (``summary.json``, ``bdsgd train --json``), from its
iteration log, whichever path ran it: SPEC's train keys first, then where things went."""

from __future__ import annotations

import numpy as np
from bdsgd.stages.smoothing import time_to_loss


def run_summary(
    log: dict,
    *,
    policy: str,
    run_id: str,
    traces: str | None,
    target_loss: float | None,
    rows_appended: int,
    final_eval: float | None = None,
    **extra,
) -> dict:
    """SPEC's train JSON of an iteration log plus its context. ``final_loss`` is the last
    held-out loss (``final_eval``, else the log's last ``eval_loss``), else the mean of the last
    ten training losses. ``extra``: what the path adds (``world_size``, ``slow_ranks``,
    ``dead_workers``, ...)."""
    c = np.asarray(log.get("c", []), dtype=float)
    it = np.asarray(log.get("iteration_s", []), dtype=float)
    decision = np.asarray(log.get("decision_ms") or [0.0], dtype=float)
    busy = float(np.sum(log.get("busy_s", [])))
    worker_seconds = float(np.sum(np.asarray(log.get("workers", []), dtype=float) * it))
    return {
        "policy": policy,
        "iterations": int(c.size),
        "wall_s": float(log["wall_s"][-1]) if c.size else 0.0,
        "throughput": float(c.sum() / it.sum()) if it.sum() > 0 else 0.0,
        "mean_c": float(c.mean()) if c.size else 0.0,
        "final_loss": final_loss(log, final_eval),
        "time_to_loss": time_to_loss(log, target_loss),
        "decision_ms_p50": float(np.percentile(decision, 50)),
        "decision_ms_p99": float(np.percentile(decision, 99)),
        "kind": "train",
        "run_id": run_id,
        "traces": traces,
        "target_loss": target_loss,
        "rows_appended": rows_appended,
        "idle_fraction": 1.0 - busy / worker_seconds if busy > 0 and worker_seconds > 0 else None,
        "mean_staleness": float(np.mean(log.get("staleness") or [0.0])),
        "dead_workers": {},
        **extra,
    }


def final_loss(log: dict, final_eval: float | None = None) -> float | None:
    """The last held-out loss, else the mean of the last ten training losses (None: none)."""
    if final_eval is not None:
        return float(final_eval)
    evals = [x for x in log.get("eval_loss", []) if x is not None]
    if evals:
        return float(evals[-1])
    losses = [x for x in log.get("loss", []) if x is not None]
    return float(np.mean(losses[-10:])) if losses else None
