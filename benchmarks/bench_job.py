"""The workflow the docs give a user, end to end on an emulated job of 4 CPU ranks: profile it
with ``full`` (120 iterations), ``bdsgd fit`` with its defaults, then ``bdsgd train`` under every
simple policy and ``bdsgd``, one after another on the same job (another seed of its delays than
the profile's).

The jobs (``--stragglers job:PRESET``, docs/stragglers.md): ``slow_rank`` (4 micro-batches of
0.04 s, rank 0 2.5x slower, a 0.6 s spell per rank and step with probability 0.08), and its
siblings ``two_slow``, ``host_spells`` and ``late_slowdown``. ``full`` (plain DDP's step: the library
measures and cuts nothing under it) runs a fixed number of iterations; every other policy runs
until its smoothed training loss reaches the one ``full`` ended at, and the table compares the
wall-clock time each took to get there.

    python -m benchmarks.bench_job --presets slow_rank,two_slow,host_spells
    python -m benchmarks.bench_job --rank0     # the coordinator's rank against the others
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
from bdsgd.stages.fit import FitConfig, run_fit
from bdsgd.stages.profile import ProfileConfig, run_profile
from bdsgd.stages.smoothing import SmoothedLoss, time_to_loss
from bdsgd.stages.store import TraceStore
from bdsgd.stages.train import TrainConfig, run_train

RANKS = 4
POLICIES = ("full", "static:3", "static:2", "ecdf", "ewma", "bdsgd")
COMMON = dict(workload="cnn", batch_size=32, micro_batches=4, allow_oversubscribe=True)


def profile_and_fit(root: Path, spec: str, iterations: int = 120) -> tuple[Path, str]:
    """The documented start: a profile under ``full``, then the default fit; a line on it."""
    run_profile(ProfileConfig(workers=RANKS, iterations=iterations, traces=root / "profile",
                              stragglers=spec, seed=0, **COMMON))  # fmt: skip
    began = time.perf_counter()
    fit = run_fit(FitConfig(traces=root / "profile", checkpoint=root / "model.pt", progress=False))
    note = (
        f"fit {time.perf_counter() - began:.0f} s, val_nll {fit.val_nll:.3f} (window "
        f"{fit.baseline_nll['window']:.3f}, ewma {fit.baseline_nll['ewma']:.3f})"
    )
    return root / "model.pt", note


def train(root: Path, spec: str, policy: str, iterations: int, ckpt: Path,
          target: float | None = None) -> tuple[dict, dict]:  # fmt: skip
    """One run; with ``target``, until the smoothed loss reaches it (at most ``iterations``)."""
    cfg = TrainConfig(workers=RANKS, iterations=iterations, policy=policy,
                      traces=root / "traces", out=root / f"run-{policy.replace(':', '')}",
                      checkpoint=ckpt if policy.startswith("bdsgd") else None,
                      stragglers=spec, seed=1, target_loss=target,
                      stop_at_target=target is not None, **COMMON)  # fmt: skip
    summary = run_train(cfg)
    return summary, pq.read_table(cfg.out / "iterations.parquet").to_pydict()


def final_smoothed(log: dict) -> float:
    smooth = SmoothedLoss()
    for loss in log["loss"]:
        smooth.add(loss)
    return float(smooth.value)


def job_table(root: Path, preset: str, iterations: int) -> list[str]:
    spec = f"job:{preset}"
    ckpt, note = profile_and_fit(root, spec)
    runs = {"full": train(root, spec, "full", iterations, ckpt)}
    target = final_smoothed(runs["full"][1])
    for policy in POLICIES[1:]:  # each until it reaches full's final loss (3x its iterations)
        runs[policy] = train(root, spec, policy, 3 * iterations, ckpt, target)
    ddp = time_to_loss(runs["full"][1], target)
    lines = [f"### `{spec}`: {note}; target loss {target:.3f} (`full` after {iterations})", "",
             "| policy | iterations | s/iteration | mean c | throughput (grad/s) | time to target "
             "(s) | vs full | decision ms p50 / p99 |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for policy, (s, log) in runs.items():
        ttl = time_to_loss(log, target)
        speedup = "-" if ttl is None or not ddp else f"{ddp / ttl:.2f}x"
        lines.append(
            f"| {policy} | {s['iterations']} | {np.mean(log['iteration_s']):.3f} | "
            f"{s['mean_c']:.2f} | {s['throughput']:.2f} | {'-' if ttl is None else f'{ttl:.1f}'} "
            f"| {speedup} | {s['decision_ms_p50']:.2f} / {s['decision_ms_p99']:.2f} |"
        )
    return lines + ["", self_check_line(runs["bdsgd"][0].get("self_check"))]


def self_check_line(check: dict | None) -> str:
    """Who decided bdsgd's iterations: the model, or its peers (and from when the model)."""
    if not check:
        return "bdsgd: no self-check"
    mark = "usable" if check["model_usable"] else (
        "uncalibrated (probation)" if check.get("on_probation") else "unusable")  # fmt: skip
    earned = check.get("earned_at")
    return (
        f"bdsgd's model: marked {mark}; its peers decided {check['leaned']} of "
        f"{check['decided']} iterations"
        + ("" if earned is None else f"; the model decided from decision {earned} on")
        + f"; rates (grad/s) {check['rates']}"
    )


def rank0_table(root: Path, iterations: int) -> list[str]:
    """Does the coordinator slow the rank it lives with? A job of equal ranks (spells only:
    ``job:slow_ranks=0``), profiled and fitted as documented, trained under ``full`` and
    ``bdsgd``: each rank's median step (its run-time, and that less its emulated device time:
    the real computation, where the coordinator's CPU work would show), over its uncensored
    rows."""
    spec = "job:slow_ranks=0"
    ckpt, note = profile_and_fit(root, spec)
    lines = [f"### Rank 0 (the coordinator's) against the others, `{spec}`: {note}", "",
             "| policy | rank 0 step (ms) | other ranks' (ms) | ratio | rank 0 computation (ms) | "
             "others' (ms) | ratio |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for policy in ("full", "bdsgd"):
        summary, _ = train(root, spec, policy, iterations, ckpt)
        rows = TraceStore(root / "traces").read().filter(
            (pl.col("run_id") == summary["run_id"]) & ~pl.col("censored")
        ).with_columns(compute=pl.col("runtime_s") - pl.col("injected_delay_s"))  # fmt: skip
        cells = []
        for column in ("runtime_s", "compute"):
            own = rows.filter(pl.col("worker") == 0)[column].median() * 1e3
            rest = rows.filter(pl.col("worker") != 0)[column].median() * 1e3
            cells += [f"{own:.1f}", f"{rest:.1f}", f"{own / rest:.3f}"]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return lines


def run(quick: bool = False, presets: str = "slow_rank,two_slow,host_spells") -> str:
    iterations = 80 if quick else 200
    lines = ["## A user's job, profile -> fit -> train (`benchmarks/bench_job.py`)", ""]
    for preset in presets.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            lines += job_table(Path(tmp), preset, iterations) + [""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--presets", default="slow_rank,two_slow,host_spells")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rank0", action="store_true", help="only the coordinator's rank's table")
    args = ap.parse_args()
    if args.rank0:
        with tempfile.TemporaryDirectory() as tmp:
            print("\n".join(rank0_table(Path(tmp), 80 if args.quick else 200)))
        return
    print(run(args.quick, args.presets))


if __name__ == "__main__":
    main()
