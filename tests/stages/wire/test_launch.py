"""Starting the worker processes (:func:`bdsgd.stages.engine.launch.spawn_workers`): Ctrl-C is the
engine's, so a worker ignores SIGINT before its module (torch) is imported."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from bdsgd.stages.engine.config import EngineConfig
from bdsgd.stages.engine.launch import join_or_kill, spawn_workers


def report_sigint(spec) -> None:
    """A worker body: write how SIGINT is handled here, and whether this module's import saw it
    ignored already (:data:`IGNORED_AT_IMPORT`)."""
    Path(spec.cfg.run_id, f"w{spec.worker_id}").write_text(str(IGNORED_AT_IMPORT))


IGNORED_AT_IMPORT = signal.getsignal(signal.SIGINT) == signal.SIG_IGN


@pytest.mark.timeout(120)
def test_a_worker_ignores_sigint_before_its_module_is_imported(tmp_path):
    """(in a worker process: in the test process itself this module was imported by pytest)"""
    cfg = EngineConfig(workers=2, iterations=1, run_id=str(tmp_path), source="train")
    before = signal.getsignal(signal.SIGINT)
    procs: list = []
    try:
        spawn_workers(cfg, 0, report_sigint, procs)
    finally:
        join_or_kill(procs, grace_s=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [(tmp_path / f"w{w}").read_text() for w in (1, 2)] == ["True", "True"]
    assert signal.getsignal(signal.SIGINT) is before  # the engine's own handling is untouched
