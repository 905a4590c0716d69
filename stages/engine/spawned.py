"""The first code a spawned worker process runs. Stopping is the launcher's (a worker ends when
the engine tells it to), but a Ctrl-C at the terminal, or a scheduler's SIGTERM (a preemption),
reaches the whole process group: a worker still importing torch would print a KeyboardInterrupt
traceback, or die before the engine could stop it between iterations. So SIGINT and SIGTERM are
ignored here first (:func:`bdsgd.stages.signals.ignore_interrupts`), and only then is the
worker's module imported. This module imports the standard library and
:mod:`bdsgd.stages.signals` alone (which imports the standard library alone), and the worker's
spec comes pickled (unpickling it imports the worker side: :mod:`bdsgd.stages.engine.worker`)."""

from __future__ import annotations

import importlib
import pickle

from bdsgd.stages.signals import ignore_interrupts


def run(target: str, spec: bytes) -> None:
    """Ignore SIGINT and SIGTERM, then call ``module:function`` ``target`` with the unpickled
    ``spec`` (pickled by the engine that spawned this process)."""
    ignore_interrupts()
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)(pickle.loads(spec))
