"""A spawned worker's first code: how an engine's worker ends (``exit_at_once``)."""

from __future__ import annotations

import atexit
import multiprocessing
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from bdsgd.stages.wire import spawned

ROOT = Path(__file__).resolve().parents[3]
KEEP: list = []  # what a child's target leaves for the interpreter's finalisation


class Finalised:
    """Writes ``finalised`` when the interpreter collects it at exit."""

    def __init__(self, folder: str) -> None:
        self.mark = Path(folder, "finalised").write_text  # bound now: globals go at exit

    def __del__(self) -> None:
        self.mark("yes")


def child(spec: dict) -> None:
    """A worker loop's stand-in: prints without flushing, registers an exit function, leaves an
    object for the finalisation, then returns or raises as ``spec["end"]`` says."""
    print("printed", end="")
    atexit.register(lambda: Path(spec["dir"], "atexit").write_text("yes"))
    KEEP.append(Finalised(spec["dir"]))
    ends = {"exit3": SystemExit(3), "exit-text": SystemExit("why"), "error": ValueError("bad")}
    if spec["end"] in ends:
        raise ends[spec["end"]]


def run_spawned(tmp_path: Path, end: str, exit_at_once: bool) -> subprocess.CompletedProcess:
    spec = pickle.dumps({"dir": str(tmp_path), "end": end})
    code = (
        "from bdsgd.stages.wire import spawned\n"
        f"spawned.run('tests.stages.wire.test_spawned:child', {spec!r}, {exit_at_once})\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_an_engine_worker_exits_without_the_interpreters_finalisation(tmp_path):
    """Its streams are flushed and its exit functions run, but what the finalisation would
    collect is left alone: the last garbage collection there once held a worker past the
    engine's grace.
    The default (a training loop's rank, the user's code) finalises as Python does."""
    out = run_spawned(tmp_path, "return", exit_at_once=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "printed"
    assert (tmp_path / "atexit").exists() and not (tmp_path / "finalised").exists()
    out = run_spawned(tmp_path, "return", exit_at_once=False)
    assert out.returncode == 0 and out.stdout == "printed", out.stderr
    assert (tmp_path / "finalised").exists()


@pytest.mark.parametrize(
    ("end", "code", "stderr"),
    [("exit3", 3, ""), ("exit-text", 1, "why"), ("error", 1, "ValueError: bad")],
)
def test_an_engine_worker_keeps_the_exit_status_a_spawned_process_has(tmp_path, end, code, stderr):
    """``SystemExit(n)`` is n, a ``SystemExit`` with a message is 1 with the message, any other
    exception 1 with its traceback: the statuses the engine reads as before."""
    fast = run_spawned(tmp_path, end, exit_at_once=True)
    assert fast.returncode == code, fast.stderr
    assert stderr in fast.stderr and fast.stdout == "printed"
    assert (tmp_path / "atexit").exists()
    usual = run_spawned(tmp_path, end, exit_at_once=False)
    assert usual.returncode == code and stderr in usual.stderr


@pytest.mark.parametrize(("end", "code"), [("return", 0), ("exit3", 3), ("error", 1)])
def test_a_spawned_process_reports_the_same_exitcode_either_way(tmp_path, end, code):
    """Started as the engine starts its workers (multiprocessing, spawn): ``Process.exitcode``
    is what multiprocessing itself gives, with and without ``exit_at_once``."""
    ctx = multiprocessing.get_context("spawn")
    spec = pickle.dumps({"dir": str(tmp_path), "end": end})
    for exit_at_once in (True, False):
        proc = ctx.Process(target=spawned.run, args=("tests.stages.wire.test_spawned:child", spec),
                           kwargs={"exit_at_once": exit_at_once}, daemon=True)  # fmt: skip
        proc.start()
        try:
            proc.join(120)
            assert proc.exitcode == code, (exit_at_once, proc.exitcode)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
