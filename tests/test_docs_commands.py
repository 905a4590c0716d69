"""The commands the docs show a newcomer run as written, at a tiny size: every command of
README.md's "The loop" block in order (profile, fit, simulate, train, report, check-traces), and
docs/library.md's training-loop snippet under torchrun. A doc whose command breaks fails here.

The README's block is schematic (``--workers N``, ``RUN...``, ``[--repair]``); its placeholders
are filled from ``PLACEHOLDERS``, a few flags make it tiny (``TINY``), and a placeholder not in
the table fails the test by name, so a rewritten README is followed, not silently skipped."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import run_in_session
from tests.stages.loop.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDERS = {  # README token -> (value for profile, value for every other command)
    "N": ("2", "2"),
    "T": ("100", "10"),
    "DIR": ("traces", "traces"),
    "RUN...": ("run", "run"),
    "RUN": ("run", "run"),
    "REPORT": ("report", "report"),
}
TINY = {"fit": ["--steps", "20"]}  # flags appended to a command, keeping it to seconds
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def fenced_block(text: str, heading: str, language: str | None = None) -> str:
    """The first fenced code block after ``heading`` (and before the next heading of its
    level), optionally only one tagged ``language``."""
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    end = text.find(f"\n{level} ", start + 1)
    section = text[start : end if end > 0 else len(text)]
    tag = re.escape(language) if language else r"[a-z]*"
    found = re.search(rf"^```{tag}\n(.*?)^```$", section, re.S | re.M)
    assert found, f"no {language or ''} code block under {heading!r}"
    return found.group(1)


def readme_commands() -> list[list[str]]:
    """The bdsgd commands of README.md's "The loop", placeholders filled, options in brackets
    dropped, comments cut."""
    block = fenced_block((ROOT / "README.md").read_text(), "## The loop")
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if not line.startswith("bdsgd "):
            continue
        line = re.sub(r"\[[^\]]*\]", "", line)
        words = shlex.split(line)[1:]
        which = 0 if words[0] == "profile" else 1
        filled = []
        for word in words:
            if word in PLACEHOLDERS:
                filled.append(PLACEHOLDERS[word][which])
            else:
                assert not re.fullmatch(r"[A-Z][A-Z.]*", word), (
                    f"README.md's loop uses a placeholder {word!r} this test cannot fill: "
                    f"add it to PLACEHOLDERS ({line})"
                )
                filled.append(word)
        commands.append(filled + TINY.get(words[0], []))
    return commands


def test_the_readme_loop_is_found_and_complete():
    names = [command[0] for command in readme_commands()]
    assert names[:2] == ["profile", "fit"] and "train" in names and "report" in names, names


@pytest.mark.slow
def test_the_readme_loop_runs_as_written(tmp_path):
    for command in readme_commands():
        done = run_in_session([sys.executable, "-m", "bdsgd_cli", *command], timeout=600,
                              cwd=tmp_path, env=ENV, stderr=subprocess.STDOUT)  # fmt: skip
        assert done.returncode == 0, f"bdsgd {shlex.join(command)}:\n{done.stdout[-3000:]}"
    assert (tmp_path / "report" / "index.md").is_file()


# What the library.md snippet leaves to the reader's script: a model, its data, a scheduler,
# the step count and the device; run on CPU ranks (gloo), and the group closed after it.
PRELUDE = """
import torch
import torch.distributed as dist
import torch.nn.functional as F

device = torch.device("cpu")
steps = 6


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def build_scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=100)


def _batches():
    g = torch.Generator().manual_seed(int(__import__("os").environ["RANK"]))
    while True:
        x = torch.randn(8, 8, generator=g)
        yield x, (x.sum(1) > 0).long()


batches = _batches()
"""
EPILOGUE = """
assert summary is None or summary["iterations"] == steps, summary
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_the_library_snippet_runs_under_torchrun(tmp_path):
    snippet = fenced_block((ROOT / "docs" / "library.md").read_text(), "## The lines to add",
                           "python")  # fmt: skip
    snippet = snippet.replace('init_process_group("nccl")', 'init_process_group("gloo")')
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + snippet + EPILOGUE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           str(script)]  # fmt: skip
    done = run_in_session(cmd, timeout=300, cwd=tmp_path, env=ENV, stderr=subprocess.STDOUT)
    assert done.returncode == 0, done.stdout[-3000:]
    assert (tmp_path / "runs" / "job" / "summary.json").is_file()
    assert any((tmp_path / "traces").glob("*.parquet"))
