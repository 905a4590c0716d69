"""The example scripts (examples/ddp_plain.py, examples/ddp_bdsgd.py) under real torchrun at a
tiny size: both train, and the bdsgd one writes a run directory and traces that report and fit
read. Skipped where transformers (the examples' extra) is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import run_in_session
from tests.stages.loop.launch import free_port
from tests.stages.loop.test_rank import SLOW_RANK0

pytest.importorskip("transformers")
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TINY = ["--steps", "4", "--batch-size", "4", "--micro-batches", "2", "--layers", "1", "--width",
        "32", "--warmup", "1"]  # fmt: skip


def torchrun(script: str, tmp_path: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(EXAMPLES / script), *TINY,
           "--metrics", str(tmp_path / f"{script}.json"), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    done = run_in_session(cmd, timeout=300, cwd=tmp_path, env=env, stderr=subprocess.STDOUT)
    assert done.returncode == 0, done.stdout[-3000:]
    return json.loads((tmp_path / f"{script}.json").read_text())


@pytest.mark.slow
def test_the_plain_and_the_bdsgd_example_train_under_torchrun(tmp_path):
    plain = torchrun("ddp_plain.py", tmp_path)
    assert [s[0] for s in plain["steps"]] == list(range(4))
    cut = torchrun("ddp_bdsgd.py", tmp_path, "--policy", "static:1", "--out", "run",
                   "--traces", "traces", "--stragglers", SLOW_RANK0)  # fmt: skip
    assert [s[3] for s in cut["steps"]] == [1] * 4  # the fast rank alone is admitted
    assert cut["summary"]["world_size"] == 2 and cut["summary"]["iterations"] == 4
    assert (tmp_path / "run" / "summary.json").is_file()
    assert any((tmp_path / "traces").glob("part-*.parquet"))
