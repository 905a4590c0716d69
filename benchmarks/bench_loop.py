"""bdsgd in a user's own loop: examples/ddp_bdsgd.py against examples/ddp_plain.py (a tiny GPT-2,
AdamW, warmup + cosine, clipping, bf16 autocast) under torchrun on CPU ranks.

    python -m benchmarks.bench_loop --ranks 4 --steps 150      # prints the Markdown section

With emulated stragglers (one persistently slow rank plus transient host slowdowns, steps of
50 ms and more): time to a target loss and the loss at equal steps of plain DDP, of ``ecdf`` and
of ``bdsgd`` (the model fitted on the measure-only run's traces: the product's own loop). Without
stragglers: steps/s of plain DDP, of the measure-only mode (``full``) and of ``ecdf``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STRAGGLERS = ("synthetic:base_s={base_s},hosts=4,slow_workers=1,slow_worker_factor=2.5,"
              "p_slow=0.05,p_recover=0.3,slow_factor=3,sigma=0.1,spike_p=0.02,drift=0")  # fmt: skip
ALPHA = 0.1  # EWMA weight of one step's loss, as bdsgd train's time_to_loss


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, ranks: int, work: Path, tag: str, *args: str) -> dict:
    """One run of an example; its metrics (rank 0's per-step wall time and loss)."""
    metrics = work / f"{tag}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks), "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(ROOT / "examples" / script),
           "--metrics", str(metrics), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{script} {tag} failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    return json.loads(metrics.read_text())


def smoothed(losses) -> np.ndarray:
    out, value = [], None
    for x in losses:
        value = x if value is None else (1 - ALPHA) * value + ALPHA * x
        out.append(value)
    return np.asarray(out)


def time_to(run: dict, target: float) -> float | None:
    steps = run["steps"]
    hit = np.flatnonzero(smoothed([s[2] for s in steps]) <= target)
    return float(steps[hit[0]][1]) if hit.size else None


def rate(run: dict, skip: int = 5) -> float:
    """Steps per second after the first ``skip`` (start-up, first compilations)."""
    steps = run["steps"]
    return (len(steps) - 1 - skip) / (steps[-1][1] - steps[skip][1])


def final_loss(run: dict, last: int = 10) -> float:
    return float(np.mean([s[2] for s in run["steps"][-last:]]))


def stragglers(base_s: float) -> str:
    """The emulated cluster: each step's injected delay around ``base_s`` seconds per rank."""
    return STRAGGLERS.format(base_s=base_s)


def straggler_runs(ranks: int, steps: int, work: Path, common: list[str],
                   base_s: float = 0.05) -> dict[str, dict]:  # fmt: skip
    slow = ["--stragglers", stragglers(base_s)]
    runs = {"plain DDP": torchrun("ddp_plain.py", ranks, work, "plain", *common, *slow)}
    runs["full (measure only)"] = torchrun("ddp_bdsgd.py", ranks, work, "full", *common, *slow,
                                           "--policy", "full", "--traces", "traces")  # fmt: skip
    fit = [sys.executable, "-m", "bdsgd_cli", "fit", "--traces", "traces", "--checkpoint",
           "model.pt", "--steps", "300"]  # fmt: skip
    subprocess.run(fit, cwd=work, check=True, capture_output=True, timeout=1800)
    runs["ecdf"] = torchrun("ddp_bdsgd.py", ranks, work, "ecdf", *common, *slow, "--policy", "ecdf")
    runs["bdsgd"] = torchrun("ddp_bdsgd.py", ranks, work, "bdsgd", *common, *slow, "--policy",
                             "bdsgd", "--model", "model.pt", "--out", "run-bdsgd")  # fmt: skip
    return runs


def clean_runs(ranks: int, work: Path, common: list[str], reverse: bool = False) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    plans = {
        "plain DDP": ("ddp_plain.py", "plain0", []),
        "full (measure only)": ("ddp_bdsgd.py", "full0", ["--policy", "full"]),
        "ecdf": ("ddp_bdsgd.py", "ecdf0", ["--policy", "ecdf"]),
    }
    order = list(plans)[::-1] if reverse else list(plans)
    runs = {name: torchrun(plans[name][0], ranks, work, plans[name][1], *common, *plans[name][2])
            for name in order}  # fmt: skip
    return {name: runs[name] for name in plans}


def clean_repeats(ranks: int, steps: int, repeats: int, work: Path) -> str:
    """Without stragglers, the three runs interleaved ``repeats`` times (the order reversed
    every other round): each one's steps/s over plain DDP's of the same round, and medians."""
    common = ["--steps", str(steps), "--batch-size", "16", "--micro-batches", "4"]
    ratios: dict[str, list[float]] = {"full (measure only)": [], "ecdf": []}
    rates: dict[str, list[float]] = {"plain DDP": [], **{k: [] for k in ratios}}
    for i in range(repeats):
        runs = clean_runs(ranks, work / f"round{i}", common, reverse=i % 2 == 1)
        for name, run in runs.items():
            rates[name].append(rate(run))
        for name in ratios:
            ratios[name].append(rate(runs[name]) / rate(runs["plain DDP"]))
    lines = [f"Without stragglers, {repeats} interleaved rounds of {steps} steps, {ranks} ranks:",
             "", "| run | steps/s, each round | median | vs plain DDP, each round | median |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, values in rates.items():
        rel = ratios.get(name)
        lines.append(f"| {name} | {' / '.join(f'{v:.2f}' for v in values)} | "
                     f"{np.median(values):.2f} | "
                     f"{'' if rel is None else ' / '.join(f'{r:.3f}' for r in rel)} | "
                     f"{'1' if rel is None else f'{np.median(rel):.3f}'}x |")  # fmt: skip
    return "\n".join(lines)


def table(runs: dict[str, dict], target: float) -> list[str]:
    base = runs["plain DDP"]
    ttl_base = time_to(base, target)
    lines = ["| run | steps/s | mean c | time to loss (s) | speed-up | loss, last 10 steps |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, run in runs.items():
        ttl = time_to(run, target)
        c = run.get("summary", {}).get("mean_c") if "summary" in run else None
        speed = f"{ttl_base / ttl:.2f}x" if ttl and ttl_base else "n/a"
        lines.append(f"| {name} | {rate(run):.2f} | {'' if c is None else f'{c:.2f}'} | "
                     f"{'not reached' if ttl is None else f'{ttl:.1f}'} | {speed} | "
                     f"{final_loss(run):.3f} |")  # fmt: skip
    return lines


def measure(ranks: int, steps: int, work: Path, base_s: float = 0.05) -> str:
    common = ["--steps", str(steps), "--batch-size", "16", "--micro-batches", "4"]
    slow = straggler_runs(ranks, steps, work, common, base_s)
    target = float(np.percentile(smoothed([s[2] for s in slow["plain DDP"]["steps"]]), 25))
    clean = clean_runs(ranks, work, common)
    ratio = {k: rate(v) / rate(clean["plain DDP"]) for k, v in clean.items()}
    return "\n".join(
        [
            "## bdsgd in a user's loop (`benchmarks/bench_loop.py`)",
            "",
            f"examples/ddp_bdsgd.py vs examples/ddp_plain.py, {ranks} CPU ranks under torchrun "
            f"(gloo), {steps} steps of a tiny GPT-2 (AdamW, warmup + cosine, clipping, bf16 "
            f"autocast, 4 micro-batches of 4 sequences per rank).",
            "",
            f"With stragglers `{stragglers(base_s)}` (rank 0 persistently 2.5x slower, host slowdowns that "
            f"come and go); target loss {target:.3f} (the plain run's smoothed loss, 25th "
            "percentile); bdsgd's model fitted (`bdsgd fit --steps 300`) on the measure-only run's "
            "traces:",
            "",
            *table(slow, target),
            "",
            "Without stragglers (steps/s relative to plain DDP): "
            + ", ".join(f"{k} {v:.3f}x" for k, v in ratio.items() if k != "plain DDP"),
            "",
        ]
    )


def seed_runs(ranks: int, steps: int, seeds: int, work: Path, base_s: float) -> str:
    """Loss at equal steps against the noise of the seeds: plain DDP, bdsgd (a cut rank's
    finished micro-batches salvaged, the library's default) and bdsgd with ``--no-salvage`` on
    the same stragglers for seeds 0..``seeds``-1 (each seed draws its own model
    init, data order and straggler pattern); bdsgd's model fitted once, on seed 0's measure-only
    run. The paired difference to plain DDP of each seed, and its mean and sd over the seeds."""
    common = ["--steps", str(steps), "--batch-size", "16", "--micro-batches", "4"]
    slow = ["--stragglers", stragglers(base_s)]
    torchrun("ddp_bdsgd.py", ranks, work, "full", *common, *slow, "--policy", "full",
             "--traces", "traces")  # fmt: skip
    subprocess.run([sys.executable, "-m", "bdsgd_cli", "fit", "--traces", "traces", "--checkpoint",
                    "model.pt", "--steps", "300"], cwd=work, check=True, capture_output=True,
                   timeout=1800)  # fmt: skip
    plans = {"plain DDP": ("ddp_plain.py", []),
             "bdsgd": ("ddp_bdsgd.py", ["--policy", "bdsgd", "--model", "model.pt"]),
             "bdsgd --no-salvage": ("ddp_bdsgd.py", ["--policy", "bdsgd", "--model", "model.pt",
                                                     "--no-salvage"])}  # fmt: skip
    loss: dict[str, list[float]] = {name: [] for name in plans}
    speed: dict[str, list[float]] = {name: [] for name in plans}
    for seed in range(seeds):
        runs = {name: torchrun(script, ranks, work, f"{name.split()[0]}{len(extra)}s{seed}",
                               *common, *slow, *extra, "--seed", str(seed))
                for name, (script, extra) in plans.items()}  # fmt: skip
        target = float(np.percentile(smoothed([s[2] for s in runs["plain DDP"]["steps"]]), 25))
        for name, one in runs.items():
            loss[name].append(final_loss(one))
            ttl, base = time_to(one, target), time_to(runs["plain DDP"], target)
            speed[name].append(base / ttl if ttl and base else float("nan"))
    lines = [f"{seeds} seeds, {steps} steps, {ranks} ranks, `{stragglers(base_s)}`:", "",
             "| run | loss, last 10 steps, each seed | minus plain DDP, each seed | mean | sd | "
             "time-to-loss speed-up, each seed |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name in plans:
        diff = np.asarray(loss[name]) - np.asarray(loss["plain DDP"])
        lines.append(f"| {name} | {' / '.join(f'{v:.3f}' for v in loss[name])} | "
                     f"{' / '.join(f'{d:+.3f}' for d in diff)} | {diff.mean():+.3f} | "
                     f"{diff.std(ddof=1) if seeds > 1 else float('nan'):.3f} | "
                     f"{' / '.join(f'{v:.2f}x' for v in speed[name])} |")  # fmt: skip
    spread = np.std(loss["plain DDP"], ddof=1) if seeds > 1 else float("nan")
    lines += ["", f"Plain DDP's loss over the seeds: sd {spread:.3f}."]
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return measure(2 if quick else 4, 30 if quick else 150, Path(tmp))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", help="also write the section here")
    ap.add_argument("--base-s", type=float, default=0.05,
                    help="the emulated step's injected delay per rank, seconds")  # fmt: skip
    ap.add_argument("--clean-repeats", type=int, default=0,
                    help="only the runs without stragglers, this many interleaved rounds")  # fmt: skip
    ap.add_argument("--seeds", type=int, default=0,
                    help="only the loss at equal steps: plain DDP and bdsgd (with and without "
                         "salvage) over this many seeds")  # fmt: skip
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.clean_repeats:
            text = clean_repeats(args.ranks, args.steps, args.clean_repeats, Path(tmp))
        elif args.seeds:
            text = seed_runs(args.ranks, args.steps, args.seeds, Path(tmp), args.base_s)
        else:
            text = measure(args.ranks, args.steps, Path(tmp), args.base_s)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
