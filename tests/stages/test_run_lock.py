"""One run per run directory: a second holder is refused in one line naming the first's pid,
and the lock dies with its holder (kill -9)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.run_lock import LOCK_FILE, RunDirLock

from tests.processes import kill_session, start_in_session

pytestmark = pytest.mark.timeout(120)

HOLD = """
import sys
from pathlib import Path
from bdsgd.stages.run_lock import RunDirLock
RunDirLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
sys.stdin.read()
"""


def test_a_second_holder_is_refused_naming_the_first_and_the_lock_dies_with_it(tmp_path):
    holder = start_in_session([sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                              stderr=None)  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"  # (as long as it takes to start)
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {holder.pid}\\)"):
            RunDirLock(tmp_path).acquire()
    finally:
        kill_session(holder, wait_s=30)
    lock = RunDirLock(tmp_path).acquire()
    assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    lock.release()


def test_release_with_remove_leaves_no_file(tmp_path):
    RunDirLock(tmp_path).acquire().release(remove=True)
    assert list(tmp_path.iterdir()) == []
