"""``bdsgd simulate``: every policy on the same run-times, and the cost of a decision vs N.

1. One synthetic drifting cluster (``SyntheticCluster``, seed 0: host-correlated slow spells,
   drift, heavy-tailed spikes), 1000 iterations x 32 workers, replayed through every default
   policy; the wall time of the whole comparison.
2. The cutoff objective with a perfect predictive: :class:`TruePredictor` samples the true
   generating process of ``SyntheticCluster`` (it knows each host's regime at t-1, the drift, the
   worker speeds), so the only difference between ``bdsgd:iteration`` (argmax c / E[x_(c)]) and
   ``bdsgd`` (the long-run objective c - lambda E[x_(c)]) is the decision rule. 3000 iterations,
   the last 20% simulated after the rest was observed, three seeds.
3. ``decision_ms`` (p50, p99 of ``choose``) for bdsgd, ewma and ecdf at N = 32 .. 1024, S = 256
   samples, after 20 observed iterations, torch on one thread (on a busy 2-core machine torch's
   default two threads made bdsgd's decision ~100x slower at N=32). bdsgd runs an untrained model of the real architecture
   (speed does not depend on the weights), so its cost is the predictor's ``sample`` plus the
   shared order-statistics objective.

Reproduce: ``.venv/bin/python -c "from benchmarks.bench_simulate import run; print(run())"``
(or ``make bench``).
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
from bdsgd.stages.policies.base import Policy
from bdsgd.stages.policies.cutoff import BdsgdCutoff
from bdsgd.stages.policies.registry import default_policy_specs, make_policy
from bdsgd.stages.simulate import SimulateConfig, compare, replay
from bdsgd.stages.store import RunMatrix
from bdsgd.stages.stragglers import SyntheticCluster

SAMPLES = 256


def synthetic_run(iterations: int, workers: int) -> RunMatrix:
    cluster = SyntheticCluster(seed=0)
    runtimes = cluster.delays(iterations, workers)
    full = np.ones(runtimes.shape, dtype=bool)
    return RunMatrix("synthetic", runtimes, ~full, full, tuple(cluster.host_of(workers)))


def policies_table(iterations: int, workers: int) -> str:
    """Every default policy on one run, best first, and how long the comparison took."""
    run = synthetic_run(iterations, workers)
    specs = default_policy_specs(workers, with_checkpoint=False)
    began = time.perf_counter()
    metrics, _ = compare(specs, run, SimulateConfig(traces=Path("synthetic")))
    seconds = time.perf_counter() - began
    lines = [
        f"Synthetic cluster (seed 0), {iterations} iterations x {workers} workers, "
        f"{len(specs)} policies in {seconds:.1f} s.",
        "",
        "| policy | mode | throughput | oracle_ratio | mean_c | decision_ms p50 | p99 | "
        "idle_fraction | staleness |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in sorted(metrics.items(), key=lambda kv: -kv[1]["throughput"]):
        lines.append(
            f"| {name} | {m['mode']} | {m['throughput']:.1f} | {m['oracle_ratio']:.3f} | "
            f"{m['mean_c']:.1f} | {m['decision_ms']:.3f} | {m['decision_ms_p99']:.3f} | "
            f"{m['idle_fraction']:.2f} | {m['mean_staleness']:.1f} |"
        )
    return "\n".join(lines)


class TruePredictor:
    """The true one-step predictive of a ``SyntheticCluster`` run (a Predictor): given the hosts'
    regimes at t-1, each host stays or switches with the chain's probabilities; drift and worker
    speeds are known; noise and spikes are drawn as the cluster draws them."""

    def __init__(self, cluster: SyntheticCluster, iterations: int, workers: int, seed: int = 1):
        terms = cluster.log_delays(iterations, workers)
        self.cluster, self.known = cluster, terms[0] + terms[1]
        self.host = np.arange(workers) % cluster.hosts
        first = [int(np.flatnonzero(self.host == h)[0]) for h in range(cluster.hosts)]
        self.slow = terms[2][:, first] > 0  # (T, hosts)
        self.rng = np.random.default_rng(seed)
        self.t = 0

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.t += 1

    def sample(self, num_samples: int) -> torch.Tensor:
        c, rng, n = self.cluster, self.rng, self.known.shape[1]
        before = self.slow[self.t - 1] if self.t > 0 else np.zeros(c.hosts, dtype=bool)
        stay_slow = np.where(before, 1 - c.p_recover, c.p_slow)
        slow = rng.random((num_samples, c.hosts)) < stay_slow
        log_x = self.known[self.t] + np.log(c.slow_factor) * slow[:, self.host]
        log_x = log_x + rng.normal(0, c.sigma, (num_samples, n))
        spikes = rng.random((num_samples, n)) < c.spike_p
        log_x = log_x + spikes * np.log(rng.pareto(c.spike_alpha, (num_samples, n)) + 1.0)
        return torch.from_numpy(np.exp(log_x))


def objective_table(iterations: int, workers: int, seeds: tuple[int, ...]) -> str:
    """oracle_ratio of a perfect predictive under both objectives, and of ewma for scale."""
    lines = [
        f"The decision rule alone: a perfect predictive (`TruePredictor`), {iterations} iterations "
        f"x {workers} workers, last 20% simulated, oracle_ratio:",
        "",
        "| seed | true model, per-iteration rate | true model, long-run (default) | ewma | "
        "ewma:iteration |",
        "|---|---|---|---|---|",
    ]
    for seed in seeds:
        cluster = SyntheticCluster(seed=seed)
        runtimes = cluster.delays(iterations, workers)
        full = np.ones(runtimes.shape, dtype=bool)
        run = RunMatrix("synthetic", runtimes, ~full, full, tuple(cluster.host_of(workers)))
        policies = [
            BdsgdCutoff(TruePredictor(cluster, iterations, workers), SAMPLES, objective)
            for objective in ("iteration", "long-run")
        ]
        policies[0].name = "true:iteration"
        policies += [make_policy(s, workers) for s in ("ewma", "ewma:iteration")]
        start = int(0.8 * iterations)
        oracle = replay(make_policy("oracle", workers), run, start, 0.0).metrics(1.0)
        cells = [
            replay(p, run, start, 0.0).metrics(oracle["throughput"])["oracle_ratio"]
            for p in policies
        ]
        lines.append(f"| {seed} | " + " | ".join(f"{v:.3f}" for v in cells) + " |")
    return "\n".join(lines)


def untrained_bdsgd(workers: int) -> BdsgdCutoff:
    """bdsgd on an untrained model of the real architecture, hosts of 8 workers."""
    from bdsgd.stages.model.data import Normaliser
    from bdsgd.stages.model.predictor import RuntimePredictor
    from bdsgd.stages.model.runtime_model import ModelConfig, RuntimeModel

    hosts = max(1, workers // 8)
    model = RuntimeModel(ModelConfig(num_workers=workers, num_hosts=hosts))
    predictor = RuntimePredictor(
        model,
        Normaliser(np.log(0.05), 0.5),
        torch.arange(1, workers + 1),
        torch.tensor([1 + w % hosts for w in range(workers)]),
        [f"host{w % hosts}" for w in range(workers)],
        seed=0,
    )
    return BdsgdCutoff(predictor, num_samples=SAMPLES)


def decision_ms(policy: Policy, workers: int, repeats: int) -> tuple[float, float]:
    """p50, p99 of ``choose`` after 20 observed iterations (choose/observe alternate)."""
    run = synthetic_run(20 + repeats, workers)
    live = np.ones(workers, dtype=bool)
    none = np.zeros(workers, dtype=bool)
    for t in range(20):
        policy.observe(run.runtimes[t], none)
    times = []
    for t in range(20, 20 + repeats):
        began = time.perf_counter()
        policy.choose(live)
        times.append((time.perf_counter() - began) * 1e3)
        policy.observe(run.runtimes[t], none)
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


def decision_table(sizes: list[int], repeats: int) -> str:
    lines = [
        f"`choose` with S = {SAMPLES}, {repeats} decisions each, ms p50 / p99:",
        "",
        "| N | bdsgd | ewma | ecdf |",
        "|---|---|---|---|",
    ]
    for n in sizes:
        policies = [
            untrained_bdsgd(n),
            make_policy("ewma", n, num_samples=SAMPLES),
            make_policy("ecdf", n, num_samples=SAMPLES),
        ]
        cells = [decision_ms(p, n, repeats) for p in policies]
        lines.append(f"| {n} | " + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in cells) + " |")
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the simulator does: small tensors, threads only contend
    try:
        return _run(quick)
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool) -> str:
    iterations, workers = (300, 16) if quick else (1000, 32)
    sizes = [32, 1024] if quick else [32, 128, 512, 1024]
    repeats = 20 if quick else 100
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"(1 thread), python {platform.python_version()}"
    )
    return "\n".join(
        [
            "## simulate",
            "",
            f'Machine: {machine}. Reproduce: `.venv/bin/python -c "from benchmarks.bench_simulate '
            f'import run; print(run(quick={quick}))"`.',
            "",
            policies_table(iterations, workers),
            "",
            objective_table(*((1000, 16, (0,)) if quick else (3000, 32, (0, 1, 2)))),
            "",
            decision_table(sizes, repeats),
            "",
        ]
    )


# -- the user's job: profile -> fit -> simulate -------------------------------------------------
JOB_POLICIES = ("full", "static:1", "static:2", "static:3", "ecdf", "ewma", "bdsgd")
JOB_RANKS, JOB_PROFILE, JOB_REPLAY = 4, 120, 400


def job_run(spec: str, iterations: int, seed: int) -> RunMatrix:
    """``iterations`` of a ``--stragglers job...`` cluster of 4 ranks, fully observed."""
    from bdsgd.stages.stragglers import parse_stragglers

    model = parse_stragglers(spec, seed=seed)
    runtimes = model.delays(iterations, JOB_RANKS)
    full = np.ones(runtimes.shape, dtype=bool)
    return RunMatrix(spec, runtimes, ~full, full, tuple(model.host_of(JOB_RANKS)))


def job_checkpoint(spec: str, work: Path) -> Path:
    """The documented workflow's model: a 120-iteration profile (seed 0) fitted with ``fit``'s
    defaults; reused when ``work`` already holds it."""
    from bdsgd.stages.fit import FitConfig, run_fit
    from bdsgd.stages.store import TraceStore, matrix_rows

    ckpt = work / spec.replace(":", "_") / "model.pt"
    if not ckpt.exists():
        store = ckpt.parent / "traces"
        TraceStore(store).append(matrix_rows(job_run(spec, JOB_PROFILE, seed=0)))
        run_fit(FitConfig(traces=store, checkpoint=ckpt, progress=False))
    return ckpt


def job_table(specs: tuple[str, ...], work: Path) -> str:
    """Every job policy on a fresh 400-iteration run (seed 1) of each spec, bdsgd with the model
    fitted on the profile: throughput, oracle_ratio, mean_c, decision_ms p50/p99, and the
    throughput with the cut ranks' finished micro-batches counted (4 per step)."""
    lines = [
        "| job | policy | throughput | with salvage | oracle_ratio | mean_c | decision_ms p50 "
        "| p99 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for spec in specs:
        ckpt = job_checkpoint(spec, work)
        run = job_run(spec, JOB_REPLAY, seed=1)
        config = SimulateConfig(traces=Path(spec), checkpoint=ckpt, micro_batches=4)
        metrics, _ = compare(list(JOB_POLICIES), run, config)
        statics = [k for k in metrics if k.startswith("static:")]
        best = max(statics, key=lambda k: metrics[k]["throughput"])
        for name in ("bdsgd", "ecdf", "ewma", best, "full"):
            m = metrics[name]
            label = f"{name} (best static)" if name == best else name
            lines.append(
                f"| `{spec}` | {label} | {m['throughput']:.2f} | {m['sample_throughput']:.2f} | "
                f"{m['oracle_ratio']:.3f} | "
                f"{m['mean_c']:.2f} | {m['decision_ms']:.2f} | {m['decision_ms_p99']:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    torch.set_num_threads(1)
    specs = tuple(sys.argv[2:]) or ("job:slow_rank", "job:two_slow", "job:host_spells")
    print(job_table(specs, Path(sys.argv[1])))
