"""Held-out replay: does the fitted model earn its place on clusters it has not seen the end of?

For each cluster: T iterations x N workers are written to a trace store, ``bdsgd fit`` (default
settings) trains on the first 80% of it, and ``bdsgd simulate --from-frac 0.8`` replays the last
20% through every cutoff policy, censored as the server would see it (the policies first observe
the earlier 80% as recorded). ``oracle_ratio`` is throughput over the oracle's on the same
run-times; "best static" is the best ``static:C`` in hindsight (C = N/2 .. N, step 2).
``bdsgd`` revises c at every arrival (online stopping, the default); ``bdsgd:fixed`` keeps the c
chosen before the iteration, and ``ewma:online`` gives the EWMA peer the same online rule, so the
table separates what the rule buys from what the model buys.

Clusters:

- ``syn0``, ``syn1``, ``syn2``: ``SyntheticCluster`` with default settings, seeds 0, 1, 2 (host
  slow spells, drift, heavy-tailed spikes; ``docs/stragglers.md``);
- ``harsh``: ``SyntheticCluster`` seed 3 with 8 hosts, four-fold slow spells entered twice as
  often, more spikes and a faster, larger drift;
- ``arrack``: *not* our generator (:func:`ar_rack_cluster`): per-worker AR(1) log-speed, host
  slowdowns of random size (x1.5 to x4) lasting gamma-distributed spells, rack-wide congestion
  bursts that decay, gamma noise and rare exponential spikes. The model's structure does not
  match it, which is the point;
- ``throttle``: *not* our generator either (:func:`throttle_cluster`): hosts slow down and recover
  gradually (no jumps), with drift, log-normal noise and Pareto spikes. The hardest of the six
  for the model: a host's workers are cut off for the whole of a slow spell, and how much slower
  than the cut they are is what censoring hides.

Reproduce: ``.venv/bin/python -c "from benchmarks.bench_heldout import run; print(run())"``
(or ``make bench``). A full run fits six models (about 3 minutes each on 2 cores, at the
default 2000 steps).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from stages.fit import FitConfig, run_fit
from stages.simulate import SimulateConfig, compare
from stages.store import RunMatrix, TraceStore, matrix_rows
from stages.stragglers import SyntheticCluster

HOLDOUT_FROM = 0.8
SYNC = ["full", "elfving", "ecdf", "ewma", "ewma:online", "bdsgd", "bdsgd:fixed"]


def ar_rack_cluster(seed: int, iterations: int, workers: int, hosts: int = 8, racks: int = 2):
    """(T, N) run-times and host names from a generator unlike ``SyntheticCluster``."""
    rng = np.random.default_rng(seed + 100)
    host = np.arange(workers) * hosts // workers
    rack = host % racks
    base = np.log(0.05) + rng.normal(0, 0.2, workers)
    ar, slow, left = np.zeros(workers), np.zeros(hosts), np.zeros(hosts, int)
    congestion = np.zeros(racks)
    out = np.zeros((iterations, workers))
    for t in range(iterations):
        ar = 0.95 * ar + rng.normal(0, 0.05, workers)
        for h in range(hosts):
            if left[h] > 0:
                left[h] -= 1
                slow[h] = slow[h] if left[h] else 0.0
            elif rng.random() < 0.008:
                slow[h], left[h] = rng.uniform(0.4, 1.4), int(rng.gamma(2.0, 25)) + 1
        bursts = (rng.random(racks) < 0.01) * rng.uniform(0.5, 1.0, racks)
        congestion = 0.9 * congestion + bursts
        noise = np.log(rng.gamma(12.0, 1 / 12.0, workers))
        spike = (rng.random(workers) < 0.005) * rng.exponential(1.0, workers)
        out[t] = np.exp(base + ar + slow[host] + congestion[rack] + noise + spike)
    return out, [f"h{h}" for h in host]


def throttle_cluster(seed: int, iterations: int, workers: int, hosts: int = 8):
    """(T, N) run-times and host names of hosts that slow down *gradually* (thermal throttling:
    each host's slowdown moves 10% of the way to a target per iteration, the target switching
    between 0 and a random 0.5-1.2 in log with probability 0.01), a cluster-wide drift, log-normal
    noise and Pareto spikes: host-correlated like the others, but without jumps."""
    rng = np.random.default_rng(seed)
    host = np.arange(workers) % hosts
    base = np.log(0.03) + rng.normal(0, 0.15, workers)
    heat, target = np.zeros(hosts), np.zeros(hosts)
    out = np.zeros((iterations, workers))
    for t in range(iterations):
        flip = rng.random(hosts) < 0.01
        target[flip] = np.where(target[flip] > 0, 0.0, rng.uniform(0.5, 1.2, flip.sum()))
        heat += 0.1 * (target - heat)
        drift = 0.3 * np.sin(2 * np.pi * t / 500)
        spike = (rng.random(workers) < 0.01) * rng.pareto(2.0, workers) * 0.5
        out[t] = np.exp(base + heat[host] + drift + rng.normal(0, 0.2, workers) + spike)
    return out, [f"n{h}" for h in host]


def synthetic(seed: int, **kwargs) -> Callable[[int, int], tuple[np.ndarray, list[str]]]:
    def make(iterations: int, workers: int):
        cluster = SyntheticCluster(seed=seed, **kwargs)
        return cluster.delays(iterations, workers), cluster.host_of(workers)

    return make


CLUSTERS: dict[str, Callable[[int, int], tuple[np.ndarray, list[str]]]] = {
    "syn0": synthetic(0),
    "syn1": synthetic(1),
    "syn2": synthetic(2),
    "harsh": synthetic(
        3,
        hosts=8,
        slow_factor=4.0,
        p_slow=0.02,
        p_recover=0.1,
        spike_p=0.03,
        drift=0.5,
        drift_period=300,
    ),
    "arrack": lambda t, n: ar_rack_cluster(0, t, n),
    "throttle": lambda t, n: throttle_cluster(5, t, n),
}


def write_store(path: Path, runtimes: np.ndarray, hosts: list[str]) -> RunMatrix:
    """One fully observed run (schema v1, source ``import``) in a new trace store."""
    full = np.ones(runtimes.shape, dtype=bool)
    run = RunMatrix("heldout", runtimes, ~full, full, tuple(hosts))
    TraceStore(path).append(matrix_rows(run))
    return run


def evaluate(name: str, iterations: int, workers: int, steps: int, root: Path) -> dict:
    """Fit on the head, replay the tail; oracle_ratio per policy and the fit's figures."""
    runtimes, hosts = CLUSTERS[name](iterations, workers)
    traces, checkpoint = root / name, root / f"{name}.pt"
    run = write_store(traces, runtimes, hosts)
    began = time.perf_counter()
    fit = run_fit(FitConfig(traces=traces, checkpoint=checkpoint, steps=steps, progress=False))
    fit_s = time.perf_counter() - began
    statics = [f"static:{c}" for c in range(workers // 2, workers + 1, 2)]
    config = SimulateConfig(traces=traces, checkpoint=checkpoint, from_frac=HOLDOUT_FROM)
    metrics, _ = compare(SYNC + statics, run, config)
    ratio = {k: m["oracle_ratio"] for k, m in metrics.items()}
    best_static = max(statics, key=ratio.__getitem__)
    return {
        "name": name,
        "fit_s": fit_s,
        "val_nll": fit.val_nll,
        "baseline_nll": fit.baseline_nll,
        "ratio": ratio,
        "best_static": best_static,
        "bdsgd_c": metrics["bdsgd"]["mean_c"],
        "bdsgd_ms": metrics["bdsgd"]["decision_ms"],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| cluster | fit s | val_nll (window / ewma) | bdsgd | mean c | decision ms p50 | "
        "bdsgd:fixed | ewma | ewma:online | ecdf | elfving | best static | full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        q, b = r["ratio"], r["baseline_nll"]
        lines.append(
            f"| {r['name']} | {r['fit_s']:.0f} | {r['val_nll']:.2f} ({b['window']:.2f} / "
            f"{b['ewma']:.2f}) | **{q['bdsgd']:.3f}** | {r['bdsgd_c']:.1f} | "
            f"{r['bdsgd_ms']:.2f} | {q['bdsgd:fixed']:.3f} | {q['ewma']:.3f} | "
            f"{q['ewma:online']:.3f} | {q['ecdf']:.3f} | {q['elfving']:.3f} | "
            f"{q[r['best_static']]:.3f} (`{r['best_static']}`) | {q['full']:.3f} |"
        )
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    iterations, workers, steps = (600, 16, 150) if quick else (2000, 32, FitConfig.steps)
    names = ["syn0", "arrack"] if quick else list(CLUSTERS)
    with tempfile.TemporaryDirectory(prefix="bdsgd-heldout-") as tmp:
        rows = [evaluate(n, iterations, workers, steps, Path(tmp)) for n in names]
    return "\n".join(
        [
            "## Held-out replay (`bdsgd fit` on the first 80%, `bdsgd simulate --from-frac 0.8`)",
            "",
            f"{iterations} iterations x {workers} workers per cluster, fit with {steps} steps; "
            "oracle_ratio of each policy on the held-out 20% (see `benchmarks/bench_heldout.py` "
            'for the clusters). Reproduce: `.venv/bin/python -c "from benchmarks.bench_heldout '
            f'import run; print(run(quick={quick}))"`.',
            "",
            table(rows),
            "",
        ]
    )
