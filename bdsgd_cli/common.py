"""Helpers shared by the click commands: error reporting, JSON output, config building."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import click
from bdsgd.stages.errors import BdsgdError
from bdsgd.stages.stop import STOP_REQUESTED

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process SIGTERM ended


def run_stage(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command body: a :class:`BdsgdError`, an OSError (a full disk) or Ctrl-C becomes
    one line on stderr and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        terminated: list[bool] = []
        try:
            with sigterm_as_ctrl_c(terminated):
                return fn(*args, **kwargs)
        except BdsgdError as exc:
            fail(f"error: {exc}")
        except OSError as exc:  # a full disk, a file the stage could not write or read
            where = f"{exc.filename}: " if exc.filename else ""
            fail(f"error: {where}{exc.strerror or exc}")
        except KeyboardInterrupt:
            why = "terminated (SIGTERM)" if terminated else "interrupted"
            click.echo(f"error: {why}; everything written so far is kept", err=True)
            sys.exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)

    return wrapper


def fail(line: str) -> None:
    """The one line on stderr and the error exit; under torchrun also the rank's error file, so
    that torchrun's failure summary shows this line as the root cause (not only "To enable
    traceback see ...", under which the line on stderr is easy to miss)."""
    click.echo(line, err=True)
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError):
            with open(error_file, "w") as fh:
                json.dump({"message": line, "timestamp": str(int(time.time()))}, fh)
    sys.exit(EXIT_ERROR)


@contextlib.contextmanager
def sigterm_as_ctrl_c(terminated: list[bool]):
    """SIGTERM (``kill``, a batch scheduler's preemption, ``docker stop``) stops a command as
    Ctrl-C does: it is turned into a SIGINT to this process, so a run ends after the iteration
    under way, with its traces, iteration log and checkpoint in agreement. ``terminated`` gets a
    True when it came. Where SIGINT is ignored (a background job of a shell script) the SIGTERM
    still stops it: raised at once outside a block that defers Ctrl-C, at the block's end inside
    one. (The spawned workers ignore both: the engine tells them to stop.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def relay(signum, frame) -> None:
        terminated.append(True)
        STOP_REQUESTED[0] = True
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            raise KeyboardInterrupt  # (no block defers it: a deferring block holds SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, relay)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def emit_json(payload: dict) -> None:
    """Print the SPEC's JSON object as the last line on stdout."""
    click.echo(json.dumps(payload, sort_keys=False, default=float))
