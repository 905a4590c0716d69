"""Every signal handler bdsgd installs, one function per intent. Ctrl-C (SIGINT) and SIGTERM
stop a run in one process, the command's; its children leave stopping to it.

- the command: :class:`SigtermAsInterrupt` turns SIGTERM into Ctrl-C around the command's body;
- the engine: :func:`hold_interrupts` holds Ctrl-C for a block whose writes land together (an
  iteration's trace rows and its metrics row) and raises it when the block ends;
  :func:`interrupt_held` says whether one is held;
- a spawned worker or rank: :func:`ignore_interrupts` (SIGINT and SIGTERM) before it imports
  torch, :func:`ignore_ctrl_c` in a worker's entry point;
- a worker rank under torchrun: :func:`default_sigterm`.

The state is the process's own: while a block holds Ctrl-C, the SIGINT handler is an
:class:`InterruptHold`, which notes what came. This module imports the standard library alone (a
spawned worker imports it first).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator


class InterruptHold:
    """The SIGINT handler while a block holds Ctrl-C: the signals that came (a SIGTERM too, handed
    on by :class:`SigtermAsInterrupt`) and when the first came."""

    def __init__(self) -> None:
        self.caught: list[int] = []
        self.since: float | None = None

    def __call__(self, signum, frame) -> None:  # no locks, no threads: it may interrupt anything
        if self.since is None:
            self.since = time.monotonic()
        self.caught.append(signum)

    def release(self, previous) -> None:
        """After the block: hand what was held to ``previous``, the SIGINT handler before it
        (Python's raises KeyboardInterrupt). Where SIGINT was ignored a held SIGINT is dropped,
        a held SIGTERM is not."""
        if self.caught and callable(previous):
            previous(signal.SIGINT, None)
        elif self.caught and (previous is not signal.SIG_IGN or signal.SIGTERM in self.caught):
            raise KeyboardInterrupt


def current_hold() -> InterruptHold | None:
    """The hold of the block holding Ctrl-C now, if one does."""
    handler = signal.getsignal(signal.SIGINT)
    return handler if isinstance(handler, InterruptHold) else None


def interrupt_held() -> bool:
    """Whether a Ctrl-C is being held (it ends the run once the block holding it ends)."""
    hold = current_hold()
    return hold is not None and hold.since is not None


@contextlib.contextmanager
def hold_interrupts() -> Iterator[None]:
    """Ctrl-C during the block is raised when it ends, so what the block writes together lands
    together or not at all; an error the block raises goes on as it is, not as a Ctrl-C. A block
    inside another changes nothing (the outer one holds the Ctrl-C until it ends), so nesting
    costs no handler swap. Outside the main thread (where Python delivers signals) nothing
    changes; where SIGINT is ignored it stays ignored. Usable as a decorator too."""
    if threading.current_thread() is not threading.main_thread() or current_hold() is not None:
        yield
        return
    hold = InterruptHold()
    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(
            signal.SIGINT, previous if previous is not None else signal.default_int_handler
        )
    hold.release(previous)


class SigtermAsInterrupt:
    """``with SigtermAsInterrupt() as sigterm:`` SIGTERM (``kill``, a batch scheduler's
    preemption, ``docker stop``) stops the block as Ctrl-C does, so a run ends after the
    iteration under way with its traces, iteration log and checkpoint in agreement;
    ``sigterm.came`` says whether one came. Where SIGINT is ignored (a background job of a shell
    script) the SIGTERM still stops it: raised at once outside a block that holds Ctrl-C, at the
    block's end inside one. The previous SIGTERM handler is back after the block. Outside the
    main thread nothing changes."""

    def __init__(self) -> None:
        self.came = False
        self.previous = None  # the SIGTERM handler before the block, while the block runs

    def __enter__(self) -> SigtermAsInterrupt:
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, self.relay)
            self.previous = previous if previous is not None else signal.SIG_DFL
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None

    def relay(self, signum, frame) -> None:
        self.came = True
        handler = signal.getsignal(signal.SIGINT)
        if isinstance(handler, InterruptHold):
            handler(signum, frame)  # raised as the block ends, even where SIGINT was ignored
        elif handler is signal.SIG_IGN:
            raise KeyboardInterrupt
        else:
            os.kill(os.getpid(), signal.SIGINT)


def ignore_interrupts() -> None:
    """A spawned child (a worker, a rank) ignores SIGINT and SIGTERM: its launcher stops it. A
    Ctrl-C at the terminal, or a scheduler's SIGTERM, reaches the whole process group; the
    launcher turns its own SIGTERM into a Ctrl-C and ends a child that does not stop with
    SIGKILL."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def ignore_ctrl_c() -> None:
    """A worker ignores SIGINT: Ctrl-C is the engine's, which tells the workers to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def default_sigterm() -> None:
    """A worker rank under torchrun dies on SIGTERM: torchrun's agent ends its ranks with it
    (SIGKILL 30 s later), and the command's :class:`SigtermAsInterrupt` would turn it into a
    SIGINT, which a worker ignores, and hold the rank for those 30 s."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
