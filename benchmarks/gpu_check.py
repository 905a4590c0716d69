"""The GPU check (``make gpu-check``): everything of bdsgd that only a GPU exercises, in one
script sized for a few minutes on one H100.

1. the CUDA tests (engine and loop: CUDA-event timing, NCCL at world size 1, replicas and ranks
   sharing one GPU over gloo with CUDA tensors);
2. the examples on the GPU in bf16: plain DDP and bdsgd measure-only (NCCL, world size 1), steps/s
   of each; bdsgd with two ranks sharing the GPU over gloo, a slow one cut; with ``--wide``,
   plain DDP against measure-only on a model the GPU, not the host, sets the pace of;
3. with ``--cpu-bench``, the CPU loop benchmark (``benchmarks/bench_loop.py``) on the machine's
   cores.

Writes a Markdown report to ``--out``. Without a GPU, the CUDA parts say so in one line each
and are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_loop import ROOT, free_port, measure, rate

GPU_MODEL = ["--layers", "4", "--width", "256", "--batch-size", "32", "--micro-batches", "4"]
WIDE_MODEL = ["--layers", "8", "--width", "1024", "--batch-size", "32", "--micro-batches", "4"]
"""``--wide``: a model whose step the GPU, not the host's launches, sets: measure-only's cost
there tells a host-side cost (the end-of-compute wait, the store calls) from a GPU-side one."""


def environment() -> list[str]:
    lines = [f"- torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"- GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                     f"{props.multi_processor_count} SMs")  # fmt: skip
    lines.append(f"- CPU cores: {os.cpu_count()}")
    return lines


def cuda_tests() -> list[str]:
    tests = ["tests/stages/loop/test_gpu.py"]
    tic = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           *tests], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    tail = done.stdout.strip().splitlines()[-12:]
    print(done.stdout[-4000:], done.stderr[-2000:], flush=True)
    return [f"### CUDA tests ({time.perf_counter() - tic:.0f} s, exit {done.returncode})", "",
            "```", *tail, "```", ""]  # fmt: skip


def example(script: str, ranks: int, work: Path, tag: str, *args: str,
            env_extra: dict | None = None) -> dict:  # fmt: skip
    """``script`` (under examples/, or an absolute path) under torchrun; its metrics JSON."""
    metrics = work / f"{tag}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           str(ranks), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           str(ROOT / "examples" / script), "--metrics", str(metrics), *args]  # fmt: skip
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", **(env_extra or {})}
    done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{script} {tag}: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    return json.loads(metrics.read_text())


def gpu_examples(work: Path) -> list[str]:
    if not torch.cuda.is_available():
        return ["### Examples on the GPU", "", "skipped: no CUDA GPU on this machine", ""]
    steps = ["--steps", os.environ.get("GPU_CHECK_STEPS", "60")]
    plain = example("ddp_plain.py", 1, work, "plain", *steps, *GPU_MODEL)
    full = example("ddp_bdsgd.py", 1, work, "full", *steps, *GPU_MODEL, "--policy", "full",
                   "--traces", "traces")  # fmt: skip
    slow = "synthetic:base_s=0.01,slow_workers=1,slow_worker_factor=20,sigma=0,spike_p=0"
    shared = example("ddp_bdsgd.py", 2, work, "shared", *steps, *GPU_MODEL, "--backend", "gloo",
                     "--policy", "static:1", "--stragglers", slow)  # fmt: skip
    admitted = [s[3] for s in shared["steps"]]
    return [
        "### Examples on the GPU (bf16 autocast, GPT-2 4 layers x 256, 4 x 8 sequences per step)",
        "",
        "| run | backend | ranks | steps/s | loss, last 10 steps |",
        "|---|---|---|---|---|",
        f"| plain DDP | nccl | 1 | {rate(plain):.2f} | {_last(plain):.3f} |",
        f"| bdsgd full (measure only) | nccl | 1 | {rate(full):.2f} | {_last(full):.3f} |",
        f"| bdsgd static:1, rank 0 20x slower | gloo, one GPU shared | 2 | {rate(shared):.2f} | "
        f"{_last(shared):.3f} |",
        "",
        f"Measure-only cost on the GPU: {rate(full) / rate(plain):.3f}x plain DDP's steps/s. "
        f"Shared-GPU run: {sum(a == 1 for a in admitted)} of {len(admitted)} steps applied one "
        "rank (the slow one cut).",
        "",
    ]


def wide_examples(work: Path) -> list[str]:
    """Plain DDP against measure-only on :data:`WIDE_MODEL`, twice each, interleaved."""
    if not torch.cuda.is_available():
        return ["### Measure-only on a GPU-bound model", "", "skipped: no CUDA GPU", ""]
    steps = ["--steps", os.environ.get("GPU_CHECK_STEPS", "60")]
    rows = []
    for i in range(2):
        plain = example("ddp_plain.py", 1, work, f"wide-plain{i}", *steps, *WIDE_MODEL)
        full = example("ddp_bdsgd.py", 1, work, f"wide-full{i}", *steps, *WIDE_MODEL,
                       "--policy", "full", "--traces", f"wide-traces{i}")  # fmt: skip
        rows.append(f"| {i + 1} | {rate(plain):.2f} | {rate(full):.2f} | "
                    f"{rate(full) / rate(plain):.3f} |")  # fmt: skip
    return ["### Measure-only on a GPU-bound model (GPT-2 8 layers x 1,024, bf16, NCCL, 1 rank)",
            "", "| round | plain DDP steps/s | measure-only steps/s | ratio |", "|---|---|---|---|",
            *rows, ""]  # fmt: skip


def _last(run: dict) -> float:
    return sum(s[2] for s in run["steps"][-10:]) / 10


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-out/gpu-check.md")
    ap.add_argument("--cpu-bench", action="store_true", help="also the CPU loop benchmark")
    ap.add_argument("--cpu-steps", type=int, default=150)
    ap.add_argument("--skip-tests", action="store_true", help="only the examples (and --cpu-bench)")
    ap.add_argument("--wide", action="store_true", help="also measure-only on a GPU-bound model")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# GPU check (`make gpu-check`)", "", *environment(), ""]
    if not torch.cuda.is_available():
        lines.append("No CUDA GPU here: the CUDA tests and the GPU examples are skipped.\n")
    parts = (
        ([] if args.skip_tests else [cuda_tests])
        + [gpu_examples]
        + ([wide_examples] if args.wide else [])
        + ([cpu_bench(args.cpu_steps)] if args.cpu_bench else [])
    )
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            try:
                lines += part(Path(tmp)) if part is not cuda_tests else part()
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                lines += [f"### {part.__name__}", "", f"FAILED: {str(exc)[-3000:]}", ""]
            out.write_text("\n".join(lines) + "\n")  # what is done so far survives a timeout
    print("\n".join(lines))


def cpu_bench(steps: int):
    def cpu_loop_benchmark(work: Path) -> list[str]:
        return [measure(4, steps, work)]

    return cpu_loop_benchmark


if __name__ == "__main__":
    main()
