"""The test helpers that run commands in sessions: a timeout reports every command's output."""

from __future__ import annotations

import sys

import pytest

from tests.processes import finish_sessions, run_in_sessions, start_in_session


def test_a_timeout_reports_the_finished_commands_too():
    """One command outlives the timeout, the other failed: the failure shows both, the finished
    one's exit status and stderr included (it is often why the other still waits). The failing
    one has ended before the wait starts, however slow the machine."""
    failer = start_in_session([sys.executable, "-c", "import sys; sys.exit('boom: node failed')"])
    failer.wait(120)
    sleeper = start_in_session([sys.executable, "-c", "import time; time.sleep(600)"])
    with pytest.raises(pytest.fail.Exception) as failed:
        finish_sessions(sleeper, failer, timeout=1)
    message = str(failed.value)
    assert "[0] still running" in message
    assert "[1] exited 1" in message and "boom: node failed" in message


def test_commands_that_finish_return_their_outputs_in_order():
    cmds = [[sys.executable, "-c", f"import sys; print({i}); sys.exit({i})"] for i in range(3)]
    done = run_in_sessions(cmds, timeout=60)
    assert [d.returncode for d in done] == [0, 1, 2]
    assert [d.stdout.strip() for d in done] == ["0", "1", "2"]
