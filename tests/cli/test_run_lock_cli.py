"""``bdsgd train --resume`` of a run directory another train is running in: one line naming
that run's pid, exit 2, and the running run goes on untouched."""

from __future__ import annotations

import pytest
from bdsgd.stages.run_lock import LOCK_FILE

from tests.cli.test_profile_cli import bdsgd
from tests.cli.test_train_cli import STARTUP_S, running, start_train, wait_until
from tests.processes import kill_session, stderr_of

pytestmark = pytest.mark.timeout(300)


def holds_lock(path, pid: int) -> bool:
    return path.is_file() and path.read_text().strip() == str(pid)


def test_a_second_resume_of_a_running_run_dir_is_refused(tmp_path):
    proc = start_train(tmp_path, iterations=10**9)
    lock = tmp_path / "run" / LOCK_FILE
    try:
        wait_until(lambda: holds_lock(lock, proc.pid) or proc.poll() is not None, STARTUP_S,
                   "the run's lock")  # fmt: skip
        assert proc.poll() is None, stderr_of(proc)
        done = bdsgd("train", "--resume", str(tmp_path / "run"), timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1
        assert f"in use by another run (pid {proc.pid})" in done.stderr
        assert running(proc.pid) and holds_lock(lock, proc.pid)
    finally:
        kill_session(proc)
