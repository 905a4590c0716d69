"""bdsgd_cli.common: SIGTERM as Ctrl-C."""

from __future__ import annotations

import contextlib
import signal

import pytest

from bdsgd_cli.common import sigterm_as_ctrl_c


def test_sigterm_becomes_a_ctrl_c_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    terminated: list[bool] = []
    with pytest.raises(KeyboardInterrupt), sigterm_as_ctrl_c(terminated):
        signal.raise_signal(signal.SIGTERM)
        for _ in range(1000):  # (the relayed SIGINT's handler runs between bytecodes)
            pass
    assert terminated == [True]
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("deferred", [False, True])
def test_where_sigint_is_ignored_sigterm_still_stops(deferred):
    """A background job of a shell script starts with SIGINT ignored: a relayed SIGINT would be
    lost. The SIGTERM is raised at once, or at the end of a block that defers Ctrl-C (which
    drops a SIGINT there)."""
    from bdsgd.stages.engine.base import interrupts_deferred
    from bdsgd.stages.stop import STOP_REQUESTED

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    terminated: list[bool] = []
    reached_the_end = []
    try:
        with pytest.raises(KeyboardInterrupt), sigterm_as_ctrl_c(terminated):
            block = interrupts_deferred() if deferred else contextlib.nullcontext()
            with block:
                signal.raise_signal(signal.SIGTERM)
                for _ in range(1000):
                    pass
                reached_the_end.append(True)
    finally:
        signal.signal(signal.SIGINT, previous)
        STOP_REQUESTED[0] = False
    assert terminated == [True]
    assert reached_the_end == ([True] if deferred else [])  # the block ran whole


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
