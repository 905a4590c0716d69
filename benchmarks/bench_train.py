"""Real ``bdsgd train`` runs (the library's loop: every rank trains) on an emulated straggler
cluster, every synchronous policy side by side.

The cluster: a synthetic drifting cluster with host-correlated slow regimes (not the defaults of
``SyntheticCluster``), N=6 ranks. Its first 70% becomes a trace store the model is fitted on; the
rest is replayed (``--stragglers replay:``) as injected delays under every policy, so each policy
meets the same held-out cluster. ``time_to_loss`` uses, for every policy, the smoothed loss that
``full`` reaches at 60% of its iterations.

Reproduce: ``make bench`` (or ``python -m benchmarks.run --only train``); the table alone:
``python -c "from benchmarks.bench_train import policies_only; print(policies_only())"``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from bdsgd.stages.fit import FitConfig, run_fit
from bdsgd.stages.smoothing import time_to_loss
from bdsgd.stages.store import TraceStore
from bdsgd.stages.stragglers import SyntheticCluster
from bdsgd.stages.train import TrainConfig, run_train

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


SPIKE_CAP_S = 5.0  # a replayed delay at most this (seed 11 holds one of 61 s, beyond --timeout)


def write_cluster(root: Path, total: int, split: float) -> tuple[Path, Path]:
    """The emulated cluster as two trace stores: the fitting part and the held-out part
    (delays capped at ``SPIKE_CAP_S``: ``full`` would wait out a 61 s spike past the
    collective timeout, and one iteration would decide the table)."""
    delays = np.minimum(CLUSTER.delays(total, WORKERS), SPIKE_CAP_S)
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


SPECS = ("full", f"static:{WORKERS - 1}", f"static:{WORKERS - 2}", "ecdf", "ewma", "bdsgd",
         "bdsgd:fixed")  # fmt: skip


def policy_runs(root: Path, late: Path, ckpt: Path, iterations: int) -> dict[str, dict]:
    """Every synchronous policy on the same held-out cluster."""
    out = {}
    for spec in SPECS:
        summary, log = train_run(root, late, ckpt, iterations, spec)
        out[spec] = {"summary": summary, "log": log}
    return out


def train_run(root: Path, late: Path, ckpt: Path, iterations: int, spec: str, **settings):
    """One ``bdsgd train`` run on the held-out cluster; its summary and iterations table."""
    name = "-".join([*map(str, settings.values()), spec.replace(":", "")])
    cfg = TrainConfig(
        workers=WORKERS,
        iterations=iterations,
        policy=spec,
        traces=root / "train-traces",
        out=root / f"run-{name}",
        checkpoint=ckpt,
        stragglers=f"replay:{late}",
        seed=0,
        allow_oversubscribe=True,
        **settings,
    )
    summary = run_train(cfg)
    return summary, pq.read_table(cfg.out / "iterations.parquet").to_pydict()


def fit_cluster(root: Path, quick: bool) -> tuple[Path, str]:
    """The held-out cluster (early part fitted, late part replayed) and a line on the fit."""
    early, late = write_cluster(root, total=1000 if quick else 2000, split=0.7)
    began = time.perf_counter()
    fit = run_fit(FitConfig(traces=early, checkpoint=root / "model.pt", progress=False))
    fitted = (
        f"model fitted in {time.perf_counter() - began:.0f} s (val_nll {fit.val_nll:.3f} vs "
        f"window {fit.baseline_nll['window']:.3f}, ewma {fit.baseline_nll['ewma']:.3f})"
    )
    return late, fitted


def policy_table(root: Path, late: Path, fitted: str, quick: bool) -> list[str]:
    """Every policy on the held-out cluster, one row each."""
    iterations = 120 if quick else 400
    runs = policy_runs(root, late, root / "model.pt", iterations)
    full_loss = [x for x in runs["full"]["log"]["loss"] if x is not None]
    mid = int(0.6 * len(full_loss))
    target = float(np.mean(full_loss[mid - 5 : mid + 5]))
    base = runs["full"]["summary"]["throughput"]
    lines = [
        f"Emulated cluster: N={WORKERS} ranks, {iterations} iterations of the held-out replay; "
        f"{fitted}. time_to_loss target: the smoothed training loss `full` reaches at 60% of "
        f"its iterations, {target:.3f}. Best static in **bold**.",
        "",
        "| policy | throughput (grad/s) | vs full | mean_c | final_loss | time_to_loss (s) | "
        "wall_s | decision_ms p50 / p99 | censored rows |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    best = _best_static(runs)
    for spec, r in runs.items():
        s = r["summary"]
        ttl = time_to_loss(r["log"], target)
        name = f"**{spec}**" if spec == best else spec
        lines.append(
            f"| {name} | {s['throughput']:.1f} | {s['throughput'] / base:.2f}x | "
            f"{s['mean_c']:.2f} | {s['final_loss']:.3f} | {_seconds(ttl)} | {s['wall_s']:.1f} | "
            f"{s['decision_ms_p50']:.2f} / {s['decision_ms_p99']:.2f} | "
            f"{_censored_rows(root / 'train-traces', s['run_id'])} |"
        )
    return lines


def policies_only(quick: bool = False) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        late, fitted = fit_cluster(root, quick)
        return "\n".join(policy_table(root, late, fitted, quick))


def _best_static(runs: dict) -> str:
    statics = [k for k in runs if k.startswith("static")]
    return max(statics, key=lambda k: runs[k]["summary"]["throughput"])


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _censored_rows(traces: Path, run_id: str) -> int:
    df = TraceStore(traces).read()
    return int(df.filter((df["run_id"] == run_id) & df["censored"]).height)


def run(quick: bool = False) -> str:
    return "\n".join(
        ["## Training on an emulated straggler cluster (`bdsgd train`)", "", policies_only(quick)]
    )
