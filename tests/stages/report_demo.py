"""Run directories shaped like ``make demo``'s, written by hand in seconds: a 300-iteration
profile replayed by simulate from iteration 240 (12 policies), and two 80-iteration train runs
(full, bdsgd) whose full run stalls at iteration 49 for ``stall`` times its median."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from bdsgd.schemas.run_dir import iterations_table, write_run_dir
from bdsgd.stages.store import TraceStore

N = 4
SYNC = ["full", "static:3", "static:2", "elfving", "ecdf", "ewma", "bdsgd", "oracle"]
ASYNC = ["k-batch-sync:3", "k-async:3", "async", "adasync"]
STALL_AT = 49


def cluster(t: int, rng: np.random.Generator) -> np.ndarray:
    """t x N run-times: 20 ms base, slow regimes (4x) that come (p 0.03) and go (p 0.1)."""
    slow = np.zeros(N, dtype=bool)
    rows = []
    for _ in range(t):
        slow = np.where(slow, rng.random(N) > 0.1, rng.random(N) < 0.03)
        rows.append(0.02 * np.where(slow, 4.0, 1.0) * rng.lognormal(0.0, 0.15, N))
    return np.array(rows)


def append_traces(store: Path, run_id: str, rt: np.ndarray, cut: np.ndarray) -> None:
    """One trace row per (iteration, worker); workers beyond the c fastest censored at the cut."""
    t = rt.shape[0]
    order = np.sort(rt, axis=1)
    cut_at = order[np.arange(t), cut - 1]
    censored = rt > cut_at[:, None]
    rows = {
        "run_id": [run_id] * (t * N),
        "iteration": np.repeat(np.arange(t), N).tolist(),
        "worker": np.tile(np.arange(N), t).tolist(),
        "host": [f"h{w}" for w in np.tile(np.arange(N), t)],
        "world_size": [N] * (t * N),
        "start_s": np.repeat(np.arange(t) * 0.05, N).tolist(),
        "runtime_s": np.where(censored, cut_at[:, None], rt).ravel().tolist(),
        "censored": censored.ravel().tolist(),
        "cutoff": np.repeat(cut, N).tolist(),
        "policy": ["full"] * (t * N),
        "source": ["train"] * (t * N),
    }
    TraceStore(store).append(rows)


def train_dir(root: Path, policy: str, rt: np.ndarray, cut: np.ndarray, pred: bool) -> Path:
    """A train run directory (SPEC summary, no target loss) over run-times ``rt``."""
    t = rt.shape[0]
    secs = np.sort(rt, axis=1)[np.arange(t), cut - 1] + 0.04  # + a 40 ms all-reduce
    rng = np.random.default_rng(len(policy))
    loss = 2.3 * np.exp(-np.cumsum(cut) / 150) + rng.normal(0, 0.03, t)
    cols = {"policy": [policy] * t, "iteration": list(range(t)), "iteration_s": secs.tolist(),
            "wall_s": np.cumsum(secs).tolist(), "c": cut.tolist(), "workers": [N] * t,
            "decision_ms": (0.3 + rng.exponential(0.2, t)).tolist(), "loss": loss.tolist()}  # fmt: skip
    if pred:
        cols |= {"pred_q10": (0.8 * secs).tolist(), "pred_q50": secs.tolist(),
                 "pred_q90": (1.3 * secs).tolist()}  # fmt: skip
    summary = {"kind": "train", "traces": str(root / "traces"), "run_id": f"train-{policy}",
               "policy": policy, "iterations": t, "wall_s": float(secs.sum()),
               "throughput": float(cut.sum() / secs.sum()), "mean_c": float(cut.mean()),
               "final_loss": float(loss[-1]), "time_to_loss": None, "target_loss": None}  # fmt: skip
    write_run_dir(root / f"run-{policy}", summary, iterations_table(cols))
    return root / f"run-{policy}"


def simulate_dir(root: Path, rt: np.ndarray, start: int) -> Path:
    """A simulate run directory replaying ``rt`` from ``start``: sync policies per iteration,
    asynchronous ones per update (three per iteration)."""
    rng = np.random.default_rng(1)
    tail = np.sort(rt[start:], axis=1)
    t = tail.shape[0]
    cols: dict[str, list] = {k: [] for k in ("policy", "iteration", "iteration_s", "wall_s",
                                             "c", "workers", "decision_ms")}  # fmt: skip
    metrics = {}
    for k, p in enumerate(SYNC + ASYNC):
        if p in ASYNC:
            it, c = np.arange(3 * t), np.full(3 * t, 3 if ":3" in p else 1)
            secs = np.repeat(tail[:, 1], 3) / 3 + 0.001 * k
        else:
            fixed = {"full": 4, "static:3": 3, "static:2": 2}.get(p)
            c = np.full(t, fixed) if fixed else rng.integers(2, 5, t)
            it, secs = np.arange(start, start + t), tail[np.arange(t), c - 1] + 0.002
        n = len(it)
        cols["policy"] += [p] * n
        cols["iteration"] += it.tolist()
        cols["iteration_s"] += secs.tolist()
        cols["wall_s"] += np.cumsum(secs).tolist()
        cols["c"] += c.tolist()
        cols["workers"] += [N] * n
        cols["decision_ms"] += (0.01 * (k + 1) + rng.exponential(0.01, n)).tolist()
        metrics[p] = {"throughput": float(c.sum() / secs.sum()), "mean_c": float(c.mean())}
    summary = {"kind": "simulate", "traces": str(root / "traces"), "workers": N,
               "iterations": t, "from_iteration": start, "run_id": "profile",
               "policies": metrics}  # fmt: skip
    write_run_dir(root / "simulate", summary, iterations_table(cols))
    return root / "simulate"


def demo_dirs(root: Path, stall: float = 30.0) -> list[Path]:
    """run-full (stalled at iteration STALL_AT), run-bdsgd and simulate, with their traces."""
    rng = np.random.default_rng(0)
    profile = cluster(300, rng)
    append_traces(root / "traces", "profile", profile, np.full(300, N))
    full, bdsgd = cluster(80, rng), cluster(80, rng)
    full[STALL_AT, 2] = stall * float(np.median(np.sort(full, axis=1)[:, -1] + 0.04))
    cut = np.where(np.sort(bdsgd, axis=1)[:, -1] > 0.05, 3, 4)
    append_traces(root / "traces", "train-full", full, np.full(80, N))
    append_traces(root / "traces", "train-bdsgd", bdsgd, cut)
    return [train_dir(root, "full", full, np.full(80, N), False),
            train_dir(root, "bdsgd", bdsgd, cut, True), simulate_dir(root, profile, 240)]  # fmt: skip
