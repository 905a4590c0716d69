"""Driver of benchmarks/gpu_diag_run.py: plain DDP and measure-only variants, interleaved, on
the GPU check's models; prints steps/s and where the host's time went, per step."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from benchmarks.bench_loop import ROOT, rate
from benchmarks.gpu_check import GPU_MODEL, WIDE_MODEL, example


def run(script: Path, work: Path, tag: str, args: list[str], env_extra: dict) -> dict:
    diag = work / f"{tag}.diag.json"
    try:
        metrics = example(str(script), 1, work, tag, *args,
                          env_extra={"DIAG_OUT": str(diag), **env_extra})  # fmt: skip
    except RuntimeError as exc:
        return {"tag": tag, "error": str(exc)[-1500:]}
    result = {"tag": tag, "steps_per_s": rate(metrics)}
    if diag.exists():
        result["breakdown"] = json.loads(diag.read_text())["ms_per_step"]
    return result


def main() -> None:
    steps = ["--steps", os.environ.get("DIAG_STEPS", "300")]
    plain = ROOT / "examples" / "ddp_plain.py"
    diag = ROOT / "benchmarks" / "gpu_diag_run.py"
    plan = [(name, model, variant) for name, model, variants in (
        ("narrow", GPU_MODEL, ["plain", "base", "nomark", "nosync", "plain", "base", "nosync"]),
        ("wide", WIDE_MODEL, ["plain", "base", "nosync"]),
    ) for variant in variants]  # fmt: skip
    out = Path(os.environ.get("OUT", "bench-out")) / "gpu-diag.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i, (name, model, variant) in enumerate(plan):
            tag = f"{i}-{name}-{variant}"
            if variant == "plain":
                res = run(plain, work, tag, [*steps, *model], {})
            else:
                res = run(diag, work, tag, [*steps, *model, "--policy", "full", "--traces",
                                            f"traces{i}"], {"DIAG": variant})  # fmt: skip
            print(json.dumps(res), flush=True)
            results.append(res)
            out.write_text(json.dumps(results, indent=1))  # what is done survives a timeout


if __name__ == "__main__":
    main()
