"""Real training runs on an emulated straggler cluster, policies side by side, and the engine's
overhead against a plain all_reduce loop.

The cluster: a synthetic drifting cluster with host-correlated slow regimes (not the defaults of
``SyntheticCluster``), N=6 workers. Its first 70% becomes a trace store the model is fitted on;
the rest is replayed (``--stragglers replay:``) as injected delays under every policy, so each
policy meets the same held-out cluster. ``time_to_loss`` uses, for every policy, the smoothed loss
that ``full`` reaches at 60% of its iterations.

Reproduce: ``make bench`` (or ``python -m benchmarks.run --only train``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from benchmarks.allreduce import allreduce_iterations_per_s
from stages.engine.launch import run_engine
from stages.engine.server import EngineConfig
from stages.fit import FitConfig, run_fit
from stages.policies.registry import make_policy
from stages.store import TraceStore
from stages.stragglers import SyntheticCluster
from stages.train import TrainConfig, run_train, time_to_loss

WORKERS = 6
CLUSTER = SyntheticCluster(
    base_s=0.04,
    hosts=3,
    worker_spread=0.1,
    sigma=0.2,
    slow_factor=4.0,
    p_slow=0.03,
    p_recover=0.08,
    drift=0.4,
    drift_period=300,
    spike_p=0.02,
    spike_alpha=1.3,
    seed=11,
)


def write_cluster(root: Path, total: int, split: float) -> tuple[Path, Path]:
    """The emulated cluster as two trace stores: the fitting part and the held-out part."""
    delays = CLUSTER.delays(total, WORKERS)
    hosts = CLUSTER.host_of(WORKERS)
    cut = int(total * split)
    stores = []
    for name, part in (("early", delays[:cut]), ("late", delays[cut:])):
        t, n = part.shape
        rows = dict(
            run_id=[f"cluster-{name}"] * (t * n),
            iteration=np.repeat(np.arange(t), n).tolist(),
            worker=np.tile(np.arange(n), t).tolist(),
            host=[hosts[w] for w in np.tile(np.arange(n), t)],
            world_size=[n] * (t * n),
            start_s=np.repeat(np.cumsum(part.max(1)) - part.max(1), n).tolist(),
            runtime_s=part.reshape(-1).tolist(),
            censored=[False] * (t * n),
            cutoff=[None] * (t * n),
            policy=["full"] * (t * n),
            source=["import"] * (t * n),
        )
        TraceStore(root / name).append(rows)
        stores.append(root / name)
    return stores[0], stores[1]


def policy_runs(root: Path, late: Path, ckpt: Path, iterations: int) -> dict[str, dict]:
    specs = [
        "full",
        f"static:{WORKERS - 1}",
        f"static:{WORKERS - 2}",
        "ecdf",
        "ewma",
        "bdsgd",
        "bdsgd:fixed",
    ]
    out = {}
    for spec in specs:
        cfg = TrainConfig(
            workers=WORKERS,
            iterations=iterations,
            policy=spec,
            traces=root / "train-traces",
            out=root / f"run-{spec.replace(':', '')}",
            checkpoint=ckpt,
            stragglers=f"replay:{late}",
            seed=0,
            lr=0.05,
        )
        summary = run_train(cfg)
        log = pq.read_table(cfg.out / "iterations.parquet").to_pydict()
        out[spec] = {"summary": summary, "log": log}
    return out


def train_section(root: Path, quick: bool) -> str:
    early, late = write_cluster(root, total=1000 if quick else 2000, split=0.7)
    began = time.perf_counter()
    fit = run_fit(
        FitConfig(
            traces=early, checkpoint=root / "model.pt", steps=300 if quick else 1000, progress=False
        )
    )
    fit_s = time.perf_counter() - began
    runs = policy_runs(root, late, root / "model.pt", 80 if quick else 200)
    full_loss = [x for x in runs["full"]["log"]["loss"] if x is not None]
    target = float(
        np.mean(full_loss[int(0.6 * len(full_loss)) - 5 : int(0.6 * len(full_loss)) + 5])
    )
    best_static = max(
        (s for s in runs if s.startswith("static")), key=lambda s: runs[s]["summary"]["throughput"]
    )
    lines = [
        f"Emulated cluster: N={WORKERS}, held-out replay; model fitted in {fit_s:.0f} s "
        f"(val_nll {fit.val_nll:.3f} vs window {fit.baseline_nll['window']:.3f}, ewma {fit.baseline_nll['ewma']:.3f}). "
        f"time_to_loss target: smoothed training loss {target:.3f}. Best static: `{best_static}`.",
        "",
        "| policy | throughput (grad/s) | vs full | mean_c | final_loss | time_to_loss (s) | wall_s | decision_ms p50 / p99 | idle_fraction | censored rows |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = runs["full"]["summary"]["throughput"]
    for spec, r in runs.items():
        s = r["summary"]
        ttl = time_to_loss(r["log"], target)
        censored = _censored_rows(root / "train-traces", s["run_id"])
        lines.append(
            f"| {spec} | {s['throughput']:.1f} | {s['throughput'] / base:.2f}x | {s['mean_c']:.2f} | "
            f"{s['final_loss']:.3f} | {'-' if ttl is None else f'{ttl:.1f}'} | {s['wall_s']:.1f} | "
            f"{s['decision_ms_p50']:.2f} / {s['decision_ms_p99']:.2f} | {s['idle_fraction']:.2f} | {censored} |"
        )
    return "\n".join(lines)


def _censored_rows(traces: Path, run_id: str) -> int:
    df = TraceStore(traces).read()
    return int(df.filter((df["run_id"] == run_id) & df["censored"]).height)


def engine_iterations_per_s(workers: int, iterations: int, micro_batches: int) -> float:
    """The engine's iterations per second (policy full, no stragglers), over all but the first
    10 iterations."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = EngineConfig(
            workers=workers,
            iterations=iterations,
            run_id="overhead",
            source="train",
            micro_batches=micro_batches,
            hosts=("local",) * workers,
        )
        res = run_engine(cfg, make_policy("full", workers), Path(tmp) / "traces", lambda t, r: None)
    wall = np.asarray(res.log["wall_s"])
    return (iterations - 10) / (wall[-1] - wall[9])


def overhead_section(quick: bool) -> str:
    """Engine (policy full, no stragglers) against all_reduce, same workers, back to back; the
    engine with the default 4 micro-batches (cut checks mid-gradient) and with 1 (the same single
    pass as the all_reduce loop)."""
    iterations = 60 if quick else 200
    lines = [
        "| workers | engine it/s (4 micro-batches) | engine it/s (1) | all_reduce it/s | "
        "ratio (4) | ratio (1) |",
        "|---|---|---|---|---|---|",
    ]
    for n in (2, 4) if quick else (2, 4, 6):
        four, one = (engine_iterations_per_s(n, iterations, m) for m in (4, 1))
        ar = allreduce_iterations_per_s(n, iterations)
        lines.append(
            f"| {n} | {four:.1f} | {one:.1f} | {ar:.1f} | {four / ar:.2f}x | {one / ar:.2f}x |"
        )
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        policies = train_section(Path(tmp), quick)
    return "\n".join(
        [
            "## Training on an emulated straggler cluster (`bdsgd train`)",
            "",
            policies,
            "",
            "## Engine overhead against plain all_reduce (no stragglers, mlp, batch 32)",
            "",
            overhead_section(quick),
            "",
            "The engine pays, per iteration, a parameter send to every worker, a store ticket per "
            "gradient, the serial step at the server while the workers wait, and (with the default "
            "4 micro-batches, so a straggler can be cut mid-gradient) four smaller passes instead of "
            "one; all_reduce pays one collective and steps on every worker at once. On a busy "
            "machine run it under `chrt -r 10`: other load hits the all_reduce ring hardest.",
        ]
    )
