"""Helpers shared by the click commands: error reporting, JSON output, config building."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import click
from bdsgd.stages.errors import BdsgdError
from bdsgd.stages.signals import SigtermAsInterrupt

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process SIGTERM ended


def run_stage(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command body: a :class:`BdsgdError`, an OSError (a full disk), Ctrl-C or SIGTERM
    (which stops it as Ctrl-C does: :class:`SigtermAsInterrupt`) becomes one line on stderr and
    a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sigterm = SigtermAsInterrupt()
        try:
            with sigterm:
                return fn(*args, **kwargs)
        except BdsgdError as exc:
            fail(f"error: {exc}")
        except OSError as exc:  # a full disk, a file the stage could not write or read
            where = f"{exc.filename}: " if exc.filename else ""
            fail(f"error: {where}{exc.strerror or exc}")
        except KeyboardInterrupt:
            why = "terminated (SIGTERM)" if sigterm.came else "interrupted"
            click.echo(f"error: {why}; everything written so far is kept", err=True)
            sys.exit(EXIT_TERMINATED if sigterm.came else EXIT_INTERRUPTED)
        finally:
            end_resource_tracker()

    return wrapper


def end_resource_tracker(timeout_s: float = 10.0) -> None:
    """multiprocessing's resource tracker, started with the first spawned worker, ends with the
    command rather than a moment after it (it exits once its pipe closes: the command waits for
    that, then kills it)."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if fd is None or pid is None:
        return
    tracker._fd = tracker._pid = None
    with contextlib.suppress(OSError):
        os.close(fd)
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.01)


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


def emit_json(payload: dict) -> None:
    """Print the SPEC's JSON object as the last line on stdout."""
    click.echo(json.dumps(payload, sort_keys=False, default=float))
