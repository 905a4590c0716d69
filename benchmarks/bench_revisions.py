"""What an online ``bdsgd`` costs the coordinator per iteration when arrivals are read in batches.

A coordinator that reads the reports already taken in one ``multi_get`` (the loop's) hands each
batch to :meth:`IterationDriver.arrive_all`: one revision per batch, at its last arrival, instead
of one per arrival. This measures the CPU of every revision of an iteration (not only the one that
ended it, which ``decision_ms`` counts) at N = 256 and 1,024, batches of 1 (one revision per
arrival), 8 and 32, and the c each way ends at:

    python -m benchmarks.bench_revisions

The default ``bdsgd`` (self-checking, online), an untrained model (the cost does not depend on
the weights), independent log-normal arrivals, one thread, CPU time of this process.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from benchmarks.bench_predictor import POLICY_SAMPLES, _predictor

BATCHES = (1, 8, 32)


def revisions(workers: int, batch: int, iterations: int) -> dict:
    """CPU ms of an iteration's arrivals (every revision in them) and the c it ended at."""
    from bdsgd.stages.policies.cutoff import BdsgdCutoff
    from bdsgd.stages.policies.driver import IterationDriver
    from bdsgd.stages.policies.registry import decision_samples, with_self_check

    pred = _predictor(workers, max(1, workers // 8))
    own = BdsgdCutoff(pred, num_samples=decision_samples(POLICY_SAMPLES, workers))
    policy = with_self_check(own, workers, 0, own.num_samples, {"objective": "long-run"})
    driver = IterationDriver(policy, workers)
    rng = np.random.default_rng(0)
    live = np.ones(workers, dtype=bool)
    cpu, cs = [], []
    for t in range(iterations):
        x = rng.lognormal(np.log(0.05), 0.5, workers)
        order = [(int(w), float(x[w])) for w in np.argsort(x)]
        driver.begin(live)
        tic = time.process_time()
        for i in range(0, workers, batch):
            if driver.arrive_all(order[i : i + batch]):
                break
        spent = time.process_time() - tic
        out = driver.end()
        if t >= 5:  # the first iterations warm the predictor's caches
            cpu.append(spent * 1e3)
            cs.append(out.c)
    return {"workers": workers, "batch": batch, "cpu_ms": float(np.median(cpu)),
            "c": float(np.mean(cs))}  # fmt: skip


def table(iterations: int = 25) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [revisions(n, b, iterations) for n in (256, 1024) for b in BATCHES]
    finally:
        torch.set_num_threads(threads)
    lines = ["| workers N | arrivals per read | CPU of an iteration's revisions, p50 ms | mean c |",
             "|---:|---:|---:|---:|"]  # fmt: skip
    lines += [f"| {r['workers']} | {r['batch']} | {r['cpu_ms']:.1f} | {r['c']:.1f} |" for r in rows]
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    """``make bench``'s section."""
    return "\n".join(["## Revisions per batch of reports (`benchmarks/bench_revisions.py`)", "",
                      table(8 if quick else 25), ""])  # fmt: skip


if __name__ == "__main__":
    print(table())
