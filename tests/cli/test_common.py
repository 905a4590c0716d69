"""bdsgd_cli.common: the one line a command ends with."""

from __future__ import annotations

import signal

import pytest


@pytest.mark.parametrize(
    ("sig", "code", "why"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
)
def test_ctrl_c_and_sigterm_end_a_command_in_one_line(capsys, sig, code, why):
    """A command ended by Ctrl-C or SIGTERM (relayed as Ctrl-C) says which in one line and exits
    as a shell reports the signal; the SIGTERM handler before the command is back after it."""
    from bdsgd_cli.common import run_stage

    @run_stage
    def signalled() -> None:
        signal.raise_signal(sig)
        for _ in range(1000):  # (a relayed SIGINT's handler runs between bytecodes)
            pass

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        signalled()
    assert exited.value.code == code
    assert capsys.readouterr().err == f"error: {why}; everything written so far is kept\n"
    assert signal.getsignal(signal.SIGTERM) is before


def test_under_torchrun_the_one_line_is_the_root_cause_torchrun_reports(tmp_path, monkeypatch):
    """A rank's BdsgdError goes to its torchrun error file, which torchrun's own failure summary
    reads (ProcessFailure): its "Root Cause" then shows the line, not a hint at tracebacks."""
    from bdsgd.stages.errors import ConfigError
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from bdsgd_cli.common import run_stage

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    @run_stage
    def refuse() -> None:
        raise ConfigError("--out /tmp/run already holds a run")

    with pytest.raises(SystemExit) as exited:
        refuse()
    assert exited.value.code == 2
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    assert failure.message == "error: --out /tmp/run already holds a run"


TRACKER = """
import multiprocessing as mp, os
from multiprocessing import resource_tracker
from bdsgd_cli.common import end_resource_tracker
p = mp.get_context("spawn").Process(target=os.getpid)
p.start(); p.join(60)
pid = resource_tracker._resource_tracker._pid
end_resource_tracker()
print(pid, os.path.exists(f"/proc/{pid}"), resource_tracker._resource_tracker._pid)
"""


@pytest.mark.timeout(120)
def test_the_resource_tracker_of_spawned_workers_ends_with_the_command():
    """A command that spawned workers has multiprocessing's resource tracker as a child; it is
    gone (reaped) when the command ends, not a moment after (which a check of the command's
    session for processes left saw as one)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", TRACKER], capture_output=True, text=True,
                         timeout=100, check=True).stdout.split()  # fmt: skip
    assert out[0].isdigit() and out[1:] == ["False", "None"], out
