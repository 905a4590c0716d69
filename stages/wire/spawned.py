"""The first code a spawned worker process runs. Stopping is the launcher's (a worker ends when
the engine tells it to), but a Ctrl-C at the terminal, or a scheduler's SIGTERM (a preemption),
reaches the whole process group: a worker still importing torch would print a KeyboardInterrupt
traceback, or die before the engine could stop it between iterations. So SIGINT and SIGTERM are
ignored here first (:func:`bdsgd.stages.signals.ignore_interrupts`), and only then is the
worker's module imported. This module imports the standard library and
:mod:`bdsgd.stages.signals` alone (which imports the standard library alone), and the worker's
spec comes pickled (unpickling it imports the worker side).

An engine's worker exits at once when its loop returns (``exit_at_once``): what it reports has
gone to the engine by then (the control store, its gloo group). The interpreter's finalisation
is skipped: its last garbage collection (objects in reference cycles, C++ destructors among
them) once held a worker past the 20 s grace the engine gives its workers before it kills them
(the worker's stack at the kill: "Garbage-collecting", no Python frame; one test run in about a
hundred under a load of five on two cores). Automatic collection is off from there, and an
exception's frames are held until the end. The registered exit functions still run and the
standard streams are flushed; non-daemon threads are not waited for. A training loop's ranks
(:mod:`bdsgd.stages.loop.local`) exit as Python does: they are the user's whole program, which
may rely on its finalisation.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback

from bdsgd.stages.signals import ignore_interrupts

KILLED_EXIT_S = 30.0  # how long a SIGKILLed worker may take to exit (seconds on a loaded machine)


def run(target: str, spec: bytes, exit_at_once: bool = False) -> None:
    """Ignore SIGINT and SIGTERM, then call ``module:function`` ``target`` with the unpickled
    ``spec`` (pickled by the engine that spawned this process); with ``exit_at_once``, then end
    the process (see the module's docstring) with the exit code a spawned process would have:
    0, a ``SystemExit``'s code, or 1 after an exception's traceback."""
    ignore_interrupts()
    if not exit_at_once:
        call(target, spec)
        return
    try:
        call(target, spec)
    except SystemExit as exc:
        exit_now(exit_code(exc))
    except BaseException:  # noqa: BLE001 (as multiprocessing does: the traceback, then 1)
        traceback.print_exc()
        exit_now(1)  # here: the exception's frames are not freed first
    exit_now(0)


def call(target: str, spec: bytes) -> None:
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)(pickle.loads(spec))


def exit_code(exc: SystemExit) -> int:
    """The exit status ``sys.exit(exc.code)`` gives: None 0, an int itself, anything else 1
    (its message is printed to stderr)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def exit_now(code: int) -> None:
    """Run the registered exit functions, flush the standard streams and end the process with
    ``code``, without the interpreter's finalisation (automatic garbage collection off first)."""
    gc.disable()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def join_or_kill(procs: list[mp.Process], grace_s: float = 10.0) -> None:
    """Wait (bounded) for the workers to exit, then kill them (they ignore SIGTERM)."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.1))
    killed = [proc for proc in procs if proc.is_alive()]
    for proc in killed:
        proc.kill()
    deadline = time.monotonic() + KILLED_EXIT_S
    for proc in killed:  # a killed process still unmaps its memory: the command outlives it
        proc.join(max(deadline - time.monotonic(), 0.1))
