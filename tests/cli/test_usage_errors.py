"""A usage error is answered before torch, Pyro, polars or pyarrow is imported: each case runs the
CLI in a fresh interpreter and reads that interpreter's ``sys.modules`` after the error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "pyro", "polars", "pyarrow")

CHILD = f"""
import json, sys
import click
from bdsgd_cli.main import cli

code, message = 0, ""
try:
    cli.main(args=sys.argv[1:], prog_name="bdsgd", standalone_mode=False)
except click.ClickException as exc:
    code, message = exc.exit_code, exc.format_message()
except SystemExit as exc:  # a stage's error: one line on stderr, then exit 2
    code = exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
print(json.dumps({{"code": code, "message": message, "heavy": heavy}}))
"""

NEW_RUN = ["--iterations", "5", "--traces", "t", "--out", "o"]


def run_cli(args: list[str], cwd) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["train", "--workers", "0", "--policy", "full", *NEW_RUN], "0 is not in the range x>=1"),
        (["train", "--workers", "2", "--policy", "ecfd", *NEW_RUN], "unknown policy 'ecfd'"),
        (["train", "--workers", "2", "--policy", "static:3", *NEW_RUN], "must be in 1..2"),
        (
            ["train", "--workers", "2", "--policy", "bdsgd", *NEW_RUN],
            "checkpoint=... in the library, --checkpoint on the CLI",
        ),
        (["train", "--workers", "2", "--policy", "full"], "missing --iterations, --traces, --out"),
        (["profile", "--workers", "0", "--iterations", "5", "--traces", "t"], "x>=1"),
        (["simulate", "--traces", ".", "--policies", "full,ewma:fast"], "policy 'ewma:fast'"),
        (["simulate", "--traces", "t"], "Directory 't' does not exist"),
        (["fit", "--traces", "t", "--checkpoint", "m.pt"], "Directory 't' does not exist"),
        (["report", "t", "--out", "o"], "Path 't' does not exist"),
    ],
)
def test_refused_before_torch_pyro_or_polars(tmp_path, args, needle):
    result, stderr = run_cli(args, tmp_path)
    assert result["code"] == 2
    assert needle in result["message"] + stderr
    assert result["heavy"] == []
    assert not (tmp_path / "o").exists() and not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    "command", ["profile", "import", "fit", "simulate", "train", "report", "check-traces"]
)
def test_help_imports_nothing_heavy(tmp_path, command):
    result, _ = run_cli([command, "--help"], tmp_path)
    assert result["code"] == 0 and result["heavy"] == []
