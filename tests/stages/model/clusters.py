"""Test clusters for the model tests: a generator of our own, unlike ``SyntheticCluster``."""

from __future__ import annotations

import numpy as np
from bdsgd.stages.store import RunMatrix, TraceStore, matrix_rows


def drifting_cluster(
    iterations: int, workers: int, hosts: int, seed: int, cutoff: int | None = None
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(T, N) run-times, censoring flags and hosts of a cluster whose hosts wander (AR(1) in log
    speed) and jump into slow spells together, whose overall speed shifts in steps, and whose
    workers have gamma-ish noise. With ``cutoff`` c the run is cut at the c-th fastest worker:
    slower workers are censored there."""
    rng = np.random.default_rng(seed)
    host = np.arange(workers) % hosts
    worker_speed = rng.normal(0.0, 0.2, workers)
    level = np.cumsum(rng.random(iterations) < 0.005) * rng.choice([-0.25, 0.25])
    ar = np.zeros((iterations, hosts))
    spell = np.zeros((iterations, hosts))
    for t in range(1, iterations):
        ar[t] = 0.97 * ar[t - 1] + rng.normal(0.0, 0.05, hosts)
        on = spell[t - 1] > 0
        spell[t] = np.where(on, rng.random(hosts) > 0.08, rng.random(hosts) < 0.02)
    log_x = np.log(0.05) + worker_speed + level[:, None] + ar[:, host] + 0.9 * spell[:, host]
    runtimes = np.exp(log_x) * rng.gamma(16.0, 1 / 16.0, (iterations, workers))
    censored = np.zeros_like(runtimes, dtype=bool)
    if cutoff is not None:
        tau = np.sort(runtimes, axis=1)[:, cutoff - 1 : cutoff]
        censored = runtimes > tau
        runtimes = np.where(censored, tau, runtimes)
    return runtimes, censored, [f"node{h}" for h in host]


def write_run(store: TraceStore, run_id: str, runtimes, censored, hosts) -> None:
    """Append one run (T, N) to a trace store as schema-v1 rows."""
    present = np.ones(runtimes.shape, dtype=bool)
    store.append(matrix_rows(RunMatrix(run_id, runtimes, censored, present, tuple(hosts))))


def tiny_store(path) -> TraceStore:
    """Two small runs of different sizes, the second one censored."""
    store = TraceStore(path)
    write_run(store, "run-a", *drifting_cluster(60, 6, 2, seed=1))
    write_run(store, "run-b", *drifting_cluster(50, 4, 2, seed=2, cutoff=3))
    return store
