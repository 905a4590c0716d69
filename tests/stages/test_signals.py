"""bdsgd.stages.signals: every handler bdsgd installs. Each test sets the dispositions it starts
from and leaves the process's handlers as it found them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from bdsgd.stages.signals import (
    SigtermAsInterrupt,
    current_hold,
    hold_interrupts,
    ignore_ctrl_c,
    interrupt_held,
)


@pytest.fixture(autouse=True)
def handlers_kept():
    """SIGINT starts with Python's handler (tests/conftest.py), SIGTERM with the default; both
    are put back after the test."""
    sigint, sigterm = signal.getsignal(signal.SIGINT), signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGINT, sigint)
    signal.signal(signal.SIGTERM, sigterm)


def pass_bytecodes() -> None:
    for _ in range(1000):  # (a Python-level handler runs between bytecodes)
        pass


@contextlib.contextmanager
def sigint_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# -- hold_interrupts ----------------------------------------------------------------------------
def test_ctrl_c_in_a_held_block_is_raised_after_it():
    """An iteration's trace rows and metrics row land together: a SIGINT between them is held
    until both are written, then raised; the handler before the block is back."""
    before = signal.getsignal(signal.SIGINT)
    written = []
    with pytest.raises(KeyboardInterrupt):
        with hold_interrupts():
            written.append("trace rows")
            os.kill(os.getpid(), signal.SIGINT)
            pass_bytecodes()
            assert interrupt_held()
            written.append("metrics row")
    assert written == ["trace rows", "metrics row"]
    assert signal.getsignal(signal.SIGINT) is before
    assert current_hold() is None and not interrupt_held()
    with hold_interrupts():  # no signal: nothing raised
        assert not interrupt_held()
        written.append("next")
    assert written[-1] == "next"


def test_a_nested_held_block_hands_ctrl_c_to_the_enclosing_one():
    """A regrouping inside an iteration's writes: the SIGINT caught by the inner block is raised
    when the outer one ends, not between the inner and the rest of the outer."""
    before = signal.getsignal(signal.SIGINT)
    written = []
    with pytest.raises(KeyboardInterrupt):
        with hold_interrupts():
            outer = current_hold()
            with hold_interrupts():
                assert current_hold() is outer  # (no second handler)
                os.kill(os.getpid(), signal.SIGINT)
                pass_bytecodes()
                written.append("inner")
            written.append("rest of the outer")
    assert written == ["inner", "rest of the outer"]
    assert signal.getsignal(signal.SIGINT) is before


def test_an_error_in_a_held_block_is_not_turned_into_ctrl_c_and_the_handler_is_back():
    """A worker failure while Ctrl-C waits: the failure is what the caller sees."""
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match="a worker died"):
        with hold_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            pass_bytecodes()
            raise RuntimeError("a worker died")
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(RuntimeError, match="no signal"):
        with hold_interrupts():
            raise RuntimeError("no signal")
    assert signal.getsignal(signal.SIGINT) is before


def test_where_ctrl_c_is_ignored_a_held_block_ignores_it_too():
    with sigint_ignored():
        with hold_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            pass_bytecodes()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_held_ctrl_c_goes_to_the_handler_before_the_block():
    seen = []
    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    with hold_interrupts():
        os.kill(os.getpid(), signal.SIGINT)
        pass_bytecodes()
        assert seen == []
    assert seen == [signal.SIGINT]


def test_outside_the_main_thread_a_held_block_changes_nothing():
    before = signal.getsignal(signal.SIGINT)
    inside = []

    def block() -> None:
        with hold_interrupts():
            inside.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=block)
    thread.start()
    thread.join()
    assert inside == [before]


# -- SigtermAsInterrupt -------------------------------------------------------------------------
def test_sigterm_becomes_a_ctrl_c_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    sigterm = SigtermAsInterrupt()
    with pytest.raises(KeyboardInterrupt), sigterm:
        signal.raise_signal(signal.SIGTERM)
        pass_bytecodes()
    assert sigterm.came
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_sigterm_handler_is_restored_after_an_error_too():
    before = signal.getsignal(signal.SIGTERM)
    sigterm = SigtermAsInterrupt()
    with pytest.raises(RuntimeError), sigterm:
        assert signal.getsignal(signal.SIGTERM) is not before
        raise RuntimeError
    assert not sigterm.came
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("held", [False, True])
def test_where_sigint_is_ignored_sigterm_still_stops(held):
    """A background job of a shell script starts with SIGINT ignored: a relayed SIGINT would be
    lost. The SIGTERM is raised at once, or at the end of a block that holds Ctrl-C."""
    sigterm = SigtermAsInterrupt()
    reached_the_end = []
    with sigint_ignored():
        with pytest.raises(KeyboardInterrupt), sigterm:
            with hold_interrupts() if held else contextlib.nullcontext():
                signal.raise_signal(signal.SIGTERM)
                pass_bytecodes()
                reached_the_end.append(True)
    assert sigterm.came
    assert reached_the_end == ([True] if held else [])  # the held block ran whole


def test_a_sigterm_stops_only_the_block_it_came_in():
    """The stop a SIGTERM asks for is its block's: after it, a new block has seen none, and where
    SIGINT is ignored a held block drops a SIGINT again."""
    first = SigtermAsInterrupt()
    with sigint_ignored():
        with pytest.raises(KeyboardInterrupt), first:
            with hold_interrupts():
                signal.raise_signal(signal.SIGTERM)
        second = SigtermAsInterrupt()
        with second:
            with hold_interrupts():
                os.kill(os.getpid(), signal.SIGINT)
                pass_bytecodes()
    assert first.came and not second.came


# -- the children's dispositions ----------------------------------------------------------------
def run_child(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that starts from Python's SIGINT handler and the default
    SIGTERM, whatever this process's dispositions are."""
    prelude = (
        "import os, signal\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_child_that_ignores_interrupts_outlives_ctrl_c_and_sigterm():
    out = run_child("""
        from bdsgd.stages.signals import ignore_interrupts
        ignore_interrupts()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        print("alive")
    """)
    assert (out.returncode, out.stdout) == (0, "alive\n"), out.stderr


def test_a_child_that_does_not_ignore_them_ends():
    """(The check above can fail.)"""
    out = run_child("""
        os.kill(os.getpid(), signal.SIGTERM)
        print("alive")
    """)
    assert out.returncode == -signal.SIGTERM


def test_default_sigterm_ends_a_rank_that_ignored_it():
    out = run_child("""
        from bdsgd.stages.signals import default_sigterm, ignore_interrupts
        ignore_interrupts()  # (as spawned)
        default_sigterm()
        os.kill(os.getpid(), signal.SIGTERM)
        print("alive")
    """)
    assert out.returncode == -signal.SIGTERM, out.stderr
    assert out.stdout == ""


def test_ignore_ctrl_c_ignores_sigint_alone():
    ignore_ctrl_c()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_module_imports_the_standard_library_alone():
    """A spawned worker imports it before anything else (torch included)."""
    out = run_child("""
        import sys
        before = set(sys.modules)
        import bdsgd.stages.signals
        added = {m.split(".")[0] for m in set(sys.modules) - before}
        print(sorted(added - set(sys.stdlib_module_names)))
    """)
    assert out.stdout == "['bdsgd']\n", out.stderr
