"""bdsgd_cli.common: SIGTERM as Ctrl-C."""

from __future__ import annotations

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


def test_where_sigint_is_ignored_sigterm_keeps_its_default():
    """A background job of a non-interactive shell starts with SIGINT ignored: a relayed SIGINT
    would be lost, and SIGTERM would no longer end the process."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with sigterm_as_ctrl_c([]):
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, previous)
