"""The model's draws against the true predictive of a synthetic cluster (issue 31).

A :class:`~bdsgd.stages.stragglers.SyntheticCluster` keeps the terms of its log delays apart
(:meth:`~bdsgd.stages.stragglers.SyntheticCluster.log_delays`), so the predictive of iteration
t given everything before it is known exactly: each worker's speed and the drift at t, each
host's regime at t drawn from its regime at t - 1 (Markov: ``p_slow``, ``p_recover``), fresh
noise and spikes. Drawn jointly, the way the model's draws are, it says what a calibrated
predictive of x_(c) and of the run-times looks like on the same held-out iterations, and where
the model's draws differ: the shape of an iteration (each within-iteration quantile minus the
median) and the level (each quantile's bias).

Reproduce (the clusters fitted by :func:`benchmarks.bench_heldout.fit_cluster`, reused from
``--root`` when there): ``python -m benchmarks.true_predictive --root out syn1 harsh``; add
``--raw`` for the model without the recalibration and the online state, ``--host-drops`` for
fits with them.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import torch
from bdsgd.stages.model.checkpoint import NO_RECALIBRATION, load_checkpoint
from bdsgd.stages.model.evaluate import Filtered, PitCollector, _observed, ks_distance, start_at
from bdsgd.stages.model.recalibrate import recalibration_spans
from bdsgd.stages.stragglers import SyntheticCluster

from benchmarks.bench_heldout import FIT_DEFAULTS, SYNTHETIC, Flags, cluster_runs, fit_cluster

QUANTILES = np.array([0.1, 0.25, 0.5, 0.66, 0.75, 0.9])
ITERATIONS, WORKERS, STEPS = 2000, 32, 2000  # bench_heldout's size for its own clusters


def true_draws(cluster: SyntheticCluster, terms: np.ndarray, t: int, samples: int,
               rng: np.random.Generator) -> np.ndarray:  # fmt: skip
    """(samples, N) joint draws of iteration t's log delays given iterations < t: the known
    terms (speed, drift), each host's regime from its regime at t - 1, noise and spikes."""
    workers = terms.shape[2]
    host = np.arange(workers) % cluster.hosts
    slow_before = np.zeros(cluster.hosts, dtype=bool)
    if t > 0:
        slow_before[host] = terms[2, t - 1] > 0
    u = rng.random((samples, cluster.hosts))
    slow = np.where(slow_before, u >= cluster.p_recover, u < cluster.p_slow)
    draws = terms[0, t] + terms[1, t] + np.log(cluster.slow_factor) * slow[:, host]
    draws = draws + rng.normal(0.0, cluster.sigma, (samples, workers))
    spikes = rng.random((samples, workers)) < cluster.spike_p
    pareto = rng.pareto(cluster.spike_alpha, (samples, workers))
    return draws + spikes * np.log(pareto + 1.0)


class Scores:
    """What one predictive's draws say about the held-out iterations (log seconds): the
    within-iteration quantiles, and the PITs of the run-times and of x_(c) at a fixed c."""

    def __init__(self, c: int) -> None:
        self.pits = PitCollector(c)
        self.quantiles: list[np.ndarray] = []  # (Q,) median over draws of each quantile

    def add(self, draws: np.ndarray, seen: np.ndarray) -> None:
        self.quantiles.append(np.median(np.quantile(draws, QUANTILES, axis=1), axis=1))
        none, every = np.zeros(seen.shape, dtype=bool), np.ones(seen.shape, dtype=bool)
        self.pits.add(draws, seen, none, every)  # nothing censored, every worker present

    def summary(self, seen: np.ndarray) -> dict:
        """``seen``: (I, Q) the observed within-iteration quantiles."""
        q = np.array(self.quantiles)
        runtime, order = np.concatenate(self.pits.runtime), np.asarray(self.pits.order)
        return {
            "shape": (q - q[:, 2:3]).mean(axis=0),
            "bias": (seen - q).mean(axis=0),
            "order_ks": ks_distance(order),
            "order_mean": float(order.mean()),
            "runtime_ks": ks_distance(runtime),
            "runtime_mean": float(runtime.mean()),
        }


def compare(name: str, root: Path, raw: bool = False, flags: Flags = FIT_DEFAULTS,
            samples: int = 256, seed: int = 0) -> dict:  # fmt: skip
    """The held-out part of cluster ``name`` (its first run, from its first recalibration
    span on) under the fitted model and under the true predictive."""
    runs, _ = cluster_runs(name, ITERATIONS, WORKERS)
    matrices, _ = fit_cluster(name, runs, STEPS, root, flags)
    cluster = SyntheticCluster(**SYNTHETIC[name])
    terms = cluster.log_delays(ITERATIONS, WORKERS)
    run = matrices[0]
    assert np.allclose(np.log(run.runtimes), terms.sum(axis=0))  # the store holds the cluster
    ckpt = load_checkpoint(root / f"{name}.pt")
    if raw:
        ckpt = dataclasses.replace(ckpt, common=NO_RECALIBRATION)
    ((start, _),) = recalibration_spans([run], 0.2)
    predictor, first = start_at(ckpt, run, start, seed, Filtered(), online=not raw)
    rng, c = np.random.default_rng(seed), round(0.66 * run.shape[1])
    model, truth, seen = Scores(c), Scores(c), []
    for t in range(first, run.shape[0]):
        x, cens, _ = _observed(run, t)
        model.add(np.log(predictor.sample(samples).numpy()), np.log(x))
        truth.add(true_draws(cluster, terms, t, samples, rng), np.log(x))
        seen.append(np.quantile(np.log(x), QUANTILES))
        predictor.observe(x, cens)
    seen = np.array(seen)
    return {"name": name, "c": c, "iterations": len(seen),
            "seen_shape": (seen - seen[:, 2:3]).mean(axis=0),
            "model": model.summary(seen), "truth": truth.summary(seen)}  # fmt: skip


def table(rows: list[dict]) -> str:
    """Markdown: per cluster, the observed shape, then each predictive's shape and bias."""
    head = " | ".join(f"q{round(100 * q)}" for q in QUANTILES)
    lines = [
        f"| cluster | what | {head} | x_(c) KS (mean PIT) | run-time KS (mean PIT) |",
        "|---|---|" + "---:|" * (len(QUANTILES) + 2),
    ]
    fmt = lambda v: " | ".join(f"{x:+.3f}" for x in v)  # noqa: E731
    for r in rows:
        lines.append(f"| {r['name']} | seen: quantile - median | {fmt(r['seen_shape'])} | | |")
        for who in ("truth", "model"):
            s = r[who]
            scores = (f"{s['order_ks']:.3f} ({s['order_mean']:.2f}) | "
                      f"{s['runtime_ks']:.3f} ({s['runtime_mean']:.2f})")  # fmt: skip
            lines.append(f"| | {who}: quantile - median | {fmt(s['shape'])} | {scores} |")
            lines.append(f"| | {who}: seen - predicted | {fmt(s['bias'])} | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("clusters", nargs="+", choices=sorted(SYNTHETIC))
    parser.add_argument("--root", type=Path, required=True, help="fits (reused when there)")
    parser.add_argument("--raw", action="store_true", help="no recalibration, no online state")
    parser.add_argument("--host-drops", action="store_true", help="fit with --host-drops")
    parser.add_argument("--host-regime", action="store_true", help="fit with --host-regime")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.root.mkdir(parents=True, exist_ok=True)
    flags = Flags(host_drops=args.host_drops, host_regime=args.host_regime)
    rows = [compare(n, args.root, args.raw, flags) for n in args.clusters]
    print(table(rows))


if __name__ == "__main__":
    main()
