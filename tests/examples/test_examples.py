"""What a user copying the examples sees: defaults in --help, a progress line every few steps,
a run saved and resumed (cut.save / cut.resume), the library's one-line error said once for
the job, and no c10d warnings without TORCH_CPP_LOG_LEVEL in the environment. Tiny sizes, 2
ranks under torchrun; skipped without transformers (the examples' extra)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import run_in_session
from tests.stages.loop.launch import free_port

pytest.importorskip("transformers")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = ["--batch-size", "4", "--micro-batches", "2", "--layers", "1", "--width", "32",
        "--warmup", "1"]  # fmt: skip


def torchrun(script: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           str(EXAMPLES / script), *TINY, *args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    env["OMP_NUM_THREADS"] = "1"
    return run_in_session(cmd, timeout=300, cwd=cwd, env=env, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("script", ["ddp_plain.py", "ddp_bdsgd.py"])
def test_help_shows_the_defaults(script):
    done = subprocess.run([sys.executable, str(EXAMPLES / script), "--help"], capture_output=True,
                          text=True, timeout=120, cwd=EXAMPLES)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "(default: 200)" in done.stdout and "(default: 10)" in done.stdout
    assert "torchrun --standalone" in done.stdout  # the docstring's command, as written


@pytest.mark.slow
def test_progress_save_and_resume(tmp_path):
    first = torchrun("ddp_bdsgd.py", tmp_path, "--steps", "4", "--policy", "full", "--out", "run",
                     "--traces", "traces", "--save-every", "2", "--log-every", "2")  # fmt: skip
    assert first.returncode == 0, first.stdout[-3000:]
    lines = [line for line in first.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"], first.stdout[-3000:]
    assert "[c10d]" not in first.stdout  # quiet without TORCH_CPP_LOG_LEVEL set outside
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    again = torchrun("ddp_bdsgd.py", tmp_path, "--steps", "6", "--policy", "full", "--out", "run",
                     "--traces", "traces", "--metrics", "m.json")  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:]
    steps = json.loads((tmp_path / "m.json").read_text())["steps"]
    assert [s[0] for s in steps] == [4, 5]  # continued after the saved step 4


@pytest.mark.slow
def test_a_missing_model_is_one_line_for_the_job(tmp_path):
    done = torchrun("ddp_bdsgd.py", tmp_path, "--steps", "2", "--policy", "bdsgd")
    assert done.returncode != 0
    errors = [line for line in done.stdout.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: policy 'bdsgd' needs a fitted model (checkpoint=... in the library, "
        "--checkpoint on the CLI)"
    ], done.stdout[-3000:]
    # no traceback from the script or the library (torchrun prints its own summary)
    assert 'ddp_bdsgd.py", line' not in done.stdout and "stages/loop/" not in done.stdout
