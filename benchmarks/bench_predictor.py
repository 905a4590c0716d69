"""Predictor speed on one CPU core: ``sample(S)`` and ``observe`` per iteration.

Targets (SPEC performance): sample p50 <= 2 ms at N=32, S=128 and <= 20 ms at N=1024;
observe about 1 ms or less at N=32. The model is untrained (speed does not depend on weights).

Reproduce: ``.venv/bin/python -c "from benchmarks.bench_predictor import run; print(run())"``
"""

from __future__ import annotations

import platform
import time

import numpy as np
import torch

from stages.model.data import Normaliser
from stages.model.predictor import RuntimePredictor
from stages.model.runtime_model import ModelConfig, RuntimeModel

SAMPLES = 128
POLICY_SAMPLES = 256  # what the bdsgd policy draws per decision


def _predictor(workers: int, hosts: int) -> RuntimePredictor:
    model = RuntimeModel(ModelConfig(num_workers=workers, num_hosts=hosts))
    names = [f"host{w % hosts}" for w in range(workers)]
    return RuntimePredictor(
        model,
        Normaliser(np.log(0.05), 0.5),
        torch.arange(1, workers + 1),
        torch.tensor([1 + w % hosts for w in range(workers)]),
        names,
        seed=0,
    )


def _percentiles_ms(fn, repeats: int) -> tuple[float, float]:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e3)
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


def measure(workers: int, repeats: int) -> dict:
    """p50/p99 of sample(128) and observe at ``workers`` workers."""
    pred = _predictor(workers, hosts=max(1, workers // 8))
    rng = np.random.default_rng(0)
    x = rng.lognormal(np.log(0.05), 0.3, (repeats + 10, workers))
    cens = rng.random((repeats + 10, workers)) < 0.1
    rows = iter(range(repeats + 10))

    def observe() -> None:
        i = next(rows)
        pred.observe(x[i], cens[i])

    obs = _percentiles_ms(observe, repeats)
    smp = _percentiles_ms(lambda: pred.sample(SAMPLES), repeats)
    return {"workers": workers, "sample": smp, "observe": obs, "remaining": remaining(pred, x[0])}


def remaining(pred: RuntimePredictor, x: np.ndarray, repeats: int = 100) -> tuple[float, float]:
    """p50/p99 of one online revision's conditional, ``remaining``, with the policy's S = 256,
    at the arrival of three quarters of the workers (its set-up for the iteration included)."""
    pred.sample(POLICY_SAMPLES)
    order = np.argsort(x)
    arrived = np.zeros(x.size, dtype=bool)
    arrived[order[: 3 * x.size // 4]] = True
    now = float(x[order[3 * x.size // 4 - 1]])
    runtimes = np.where(arrived, x, 0.0)

    def call() -> None:
        pred._arrivals = None  # as at an iteration's first revision
        pred.remaining(now, runtimes, arrived, ~arrived)

    return _percentiles_ms(call, repeats)


def run(quick: bool = False) -> str:
    """Markdown section: sample/observe latency at N = 32, 256, 1024 on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = [measure(n, 50 if quick else 300) for n in (32, 256, 1024)]
    finally:
        torch.set_num_threads(threads)
    lines = [
        "## Predictor latency (`stages.model.predictor`)",
        "",
        f"One CPU thread, S = {SAMPLES} joint samples; machine: {platform.machine()}, "
        f"{platform.processor() or platform.platform()}, torch {torch.__version__}.",
        "",
        "| workers N | sample p50 ms | sample p99 ms | observe p50 ms | observe p99 ms | "
        "remaining p50 ms | remaining p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        (s50, s99), (o50, o99), (r50, r99) = r["sample"], r["observe"], r["remaining"]
        lines.append(
            f"| {r['workers']} | {s50:.3f} | {s99:.3f} | {o50:.3f} | {o99:.3f} | {r50:.3f} | "
            f"{r99:.3f} |"
        )
    lines += [
        "",
        "Targets: sample p50 <= 2 ms at N=32 and <= 20 ms at N=1024; observe ~1 ms at N=32. "
        "`remaining` is one online revision's conditional (S = 256 after a quarter of the "
        "workers is still out), the part of a `bdsgd` revision that grows with N.",
        "",
        'Reproduce: `.venv/bin/python -c "from benchmarks.bench_predictor import run; '
        'print(run())"`',
        "",
    ]
    return "\n".join(lines)
