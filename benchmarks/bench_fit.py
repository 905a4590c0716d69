"""``bdsgd fit`` with default settings on synthetic drifting clusters: time and held-out NLL.

Each case writes a trace store of N workers x T iterations from :class:`SyntheticCluster` (host-
correlated slow regimes, drift, heavy-tailed spikes), some of it censored at a cutoff, runs
``run_fit`` with the default ``FitConfig`` and reports the fit's CPU and wall seconds (training and
evaluation), the load average after it (the CPU seconds grow with it on a shared machine) and
the held-out one-step-ahead NLL of the model and the ``window``/``ewma`` baselines.

Reproduce: ``.venv/bin/python -c "from benchmarks.bench_fit import run; print(run())"``

:func:`profile_fit` fits the profile a user takes of a small job (:func:`straggling_job`: 4
ranks x 120 iterations, one rank 2.5x slower, 0.6 s spells) and scores the model on the job's
next run, from its first iteration:
``.venv/bin/python -c "from benchmarks.bench_fit import profile_fit; print(profile_fit())"``
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
from bdsgd.stages.fit import AUTO_MAX_STEPS, FitConfig, run_fit
from bdsgd.stages.model.checkpoint import load_checkpoint
from bdsgd.stages.model.evaluate import PitCollector, baseline_log_lik, model_log_lik
from bdsgd.stages.store import RunMatrix, TraceStore, matrix_rows
from bdsgd.stages.stragglers import SyntheticCluster

CASES = {
    "defaults": SyntheticCluster(seed=1, hosts=8),
    "harsh": SyntheticCluster(
        seed=2, hosts=8, p_slow=0.03, slow_factor=2.0, drift=0.5, drift_period=250, sigma=0.1
    ),
}


def straggling_job(
    seed: int,
    iterations: int = 120,
    workers: int = 4,
    micro_batches: int = 4,
    device_s: float = 0.04,
    slow_factor: float = 2.5,
    spell_s: float = 0.6,
    spell_p: float = 0.08,
) -> tuple[np.ndarray, list[str]]:
    """(T, N) run-times of a small data-parallel job on one host, as its profile records them:
    each step is ``micro_batches`` micro-batches of ``device_s`` emulated device time plus the
    host's own compute (about 12 ms each, log-normal, sd 0.35 in log); rank 0 is persistently
    ``slow_factor`` times slower on the device; each rank, each step, has a spell of
    ``spell_s`` seconds with probability ``spell_p``; the machine's load moves every rank of a
    step together by a log-normal factor (sd 0.03)."""
    rng = np.random.default_rng(seed)
    factor = np.ones(workers)
    factor[0] = slow_factor
    own = 0.012 * np.exp(rng.normal(0.0, 0.35, (iterations, workers, micro_batches)))
    x = (device_s * factor[None, :, None] + own).sum(-1)
    x += (rng.random((iterations, workers)) < spell_p) * spell_s
    x *= np.exp(rng.normal(0.0, 0.03, (iterations, 1)))
    return x, ["host0"] * workers


def write_cluster(
    store: TraceStore, cluster: SyntheticCluster, workers: int, iterations: int
) -> None:
    """One run of ``cluster``; every 4th iteration is cut at the (N-2)-th arrival (censored)."""
    x = cluster.delays(iterations, workers)
    tau = np.sort(x, axis=1)[:, workers - 3 : workers - 2]
    cut = (np.arange(iterations) % 4 == 0)[:, None] & (x > tau)
    it, wk = np.meshgrid(np.arange(iterations), np.arange(workers), indexing="ij")
    hosts = cluster.host_of(workers)
    rows = iterations * workers
    store.append(
        {
            "run_id": ["bench"] * rows,
            "iteration": it.ravel().tolist(),
            "worker": wk.ravel().tolist(),
            "host": [hosts[w] for w in wk.ravel()],
            "world_size": [workers] * rows,
            "start_s": np.zeros(rows).tolist(),
            "runtime_s": np.where(cut, tau, x).ravel().tolist(),
            "censored": cut.ravel().tolist(),
            "cutoff": [None] * rows,
            "policy": ["bench"] * rows,
            "source": ["import"] * rows,
        }
    )


def measure(name: str, workers: int, iterations: int, steps: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        store = TraceStore(Path(tmp) / "traces")
        write_cluster(store, CASES[name], workers, iterations)
        config = FitConfig(
            traces=store.path, checkpoint=Path(tmp) / "m.pt", steps=steps, progress=False,
            auto_host_ks=1.0,  # one fit's cost: a refit (FitConfig.auto_host_ks) would double it
        )  # fmt: skip
        began = time.process_time()
        result = run_fit(config)
        cpu_s = time.process_time() - began
    return {
        "case": name,
        "N": workers,
        "T": iterations,
        "steps": steps,
        "cpu_s": cpu_s,
        "load": os.getloadavg()[0],
        **result.to_json(),
    }


def fit_cpu_s(workers: int, iterations: int, steps: int) -> float:
    """CPU seconds of one ``run_fit`` of the ``defaults`` cluster (all of it: training,
    recalibration, evaluation, the checkpoint)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = TraceStore(Path(tmp) / "traces")
        write_cluster(store, CASES["defaults"], workers, iterations)
        config = FitConfig(
            traces=store.path, checkpoint=Path(tmp) / "m.pt", steps=steps, progress=False,
            auto_host_ks=1.0,  # one fit's cost: a refit (FitConfig.auto_host_ks) would double it
        )  # fmt: skip
        began = time.process_time()
        run_fit(config)
        return time.process_time() - began


def _store_of(path: Path, x: np.ndarray, hosts: list[str], run_id: str) -> TraceStore:
    store = TraceStore(path)
    full = np.ones(x.shape, dtype=bool)
    store.append(matrix_rows(RunMatrix(run_id, x, ~full, full, tuple(hosts))))
    return store


def next_run_scores(checkpoint: Path, x: np.ndarray, hosts: list[str], samples: int = 256) -> dict:
    """The fitted model on a new run of the same job, from its first iteration (as ``train``
    meets it): NLL per run-time of the model and the baselines, and the PIT KS of its T x N
    run-times and T x_(c)."""
    ckpt = load_checkpoint(checkpoint)
    full = np.ones(x.shape, dtype=bool)
    run = RunMatrix("next", x, ~full, full, tuple(hosts))
    pits = PitCollector()
    model = model_log_lik(ckpt, run, 0, samples, 0, pits, 0)
    window, ewma = baseline_log_lik(run, 0)
    summary = pits.summary()
    return {
        "nll": -model / x.size,
        "window": -window / x.size,
        "ewma": -ewma / x.size,
        "runtime_ks": summary["runtime"]["ks"],
        "runtime_count": summary["runtime"]["count"],
        "order_ks": summary["order_stat"]["ks"],
        "order_count": summary["order_stat"]["count"],
    }


def profile_fit(seed: int = 0, iterations: int = 120, workers: int = 4, **fit_kwargs) -> dict:
    """``fit`` (defaults but ``fit_kwargs``) of a profile of :func:`straggling_job`: its wall
    seconds, its own held-out figures, and :func:`next_run_scores` on the job's next run."""
    with tempfile.TemporaryDirectory() as tmp:
        x, hosts = straggling_job(seed, iterations, workers)
        store = _store_of(Path(tmp) / "traces", x, hosts, "profile")
        config = FitConfig(traces=store.path, checkpoint=Path(tmp) / "m.pt", progress=False,
                           **fit_kwargs)  # fmt: skip
        began = time.perf_counter()
        result = run_fit(config)
        wall_s = time.perf_counter() - began
        following, _ = straggling_job(seed + 1000, iterations, workers)
        return {"wall_s": wall_s, "load": os.getloadavg()[0], **result.to_json(),
                "next_run": next_run_scores(config.checkpoint, following, hosts)}  # fmt: skip


def job_profile_fit(preset: str, iterations: int = 120) -> dict:
    """The documented profile of an emulated job (``job:PRESET``, 4 CPU ranks on the loop,
    seed 0), ``fit`` with its defaults, and :func:`next_run_scores` on a second profile of the
    same job (seed 1), from its first iteration: what ``train`` meets.
    ``.venv/bin/python -c "from benchmarks.bench_fit import job_profile_fit as f;
    print(f('host_spells'))"``"""
    from bdsgd.stages.profile import ProfileConfig, run_profile
    from bdsgd.stages.store import TraceStore

    common = dict(workers=4, iterations=iterations, stragglers=f"job:{preset}", workload="cnn",
                  batch_size=32, micro_batches=4, allow_oversubscribe=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for seed, name in ((0, "profile"), (1, "next")):
            run_profile(ProfileConfig(traces=root / name, seed=seed, **common))
        config = FitConfig(traces=root / "profile", checkpoint=root / "m.pt", progress=False)
        began = time.perf_counter()
        result = run_fit(config)
        wall_s = time.perf_counter() - began
        (following,) = TraceStore(root / "next").run_matrices()
        scores = next_run_scores(config.checkpoint, following.runtimes, list(following.hosts))
        return {"wall_s": wall_s, **result.to_json(), "next_run": scores,
                "common": list(load_checkpoint(config.checkpoint).common)}  # fmt: skip


def cost_row(workers: int, short: int = 200, steps: int = 12) -> dict:
    """The CPU cost of an SVI step and of a trace iteration at ``workers``: fits with 2 and
    ``steps`` steps of ``short`` iterations, and with 2 steps of twice as many."""
    fit_cpu_s(workers, short, 2)  # warm-up (imports, allocator)
    base = fit_cpu_s(workers, short, 2)
    per_step = (fit_cpu_s(workers, short, steps) - base) / (steps - 2)
    per_iteration = (fit_cpu_s(workers, 2 * short, 2) - base) / short
    return {"N": workers, "step_s": per_step, "iteration_s": per_iteration, "fixed_s": base}


def cost_table(sizes: tuple[int, ...] = (32, 256, 1024)) -> list[str]:
    """Markdown rows: fit CPU cost against N, and the default fit predicted at T = 500, 2,000."""
    steps = AUTO_MAX_STEPS  # the most a default fit plans
    lines = [
        "| N | CPU s per SVI step | CPU ms per trace iteration | default fit, T = 500 (CPU s) "
        "| default fit, T = 2,000 (CPU s) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in map(cost_row, sizes):
        at = [steps * r["step_s"] + t * r["iteration_s"] for t in (500, 2000)]
        lines.append(
            f"| {r['N']} | {r['step_s']:.3f} | {r['iteration_s'] * 1e3:.1f} | {at[0]:.0f} "
            f"| {at[1]:.0f} |"
        )
    return lines


def run(quick: bool = False) -> str:
    """Markdown section: fit time and held-out NLL, 32 workers x 2000 iterations (quick: 500)."""
    steps = 100 if quick else None  # None: the default (--steps auto, early stop)
    results = [measure(name, 32, 500 if quick else 2000, steps) for name in CASES]
    lines = [
        "## Fit (`bdsgd fit`, default settings)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), fit on 1 torch thread.",
        "",
        "| cluster | N x T | steps | CPU s | wall s | load | val_nll model | window | ewma |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        b = r["baseline_nll"]
        lines.append(
            f"| {r['case']} | {r['N']} x {r['T']} | {r['steps']} | {r['cpu_s']:.1f} "
            f"| {r['fit_s']:.0f} | {r['load']:.1f} | {r['val_nll']:.4f} | {b['window']:.4f} "
            f"| {b['ewma']:.4f} |"
        )
    lines += [
        "",
        "NLL: nats per held-out run-time (last 20% of the run), lower is better.",
        "",
        'Reproduce: `.venv/bin/python -c "from benchmarks.bench_fit import run; print(run())"`',
        "",
    ]
    if not quick:
        lines += [
            "Fit cost against N (CPU seconds of the fitting process; `cost_table()`):",
            "",
            *cost_table(),
            "",
        ]
    return "\n".join(lines)
