"""The first code a spawned worker process runs. Ctrl-C is the engine's (a worker ends when the
engine tells it to), but a Ctrl-C at the terminal reaches the whole process group: a worker still
importing torch, before :func:`bdsgd.stages.engine.worker.worker_entry` ignores SIGINT, would
print a KeyboardInterrupt traceback. So SIGINT is ignored here first, and only then is the
worker's module imported. SIGTERM too: the command turns its own SIGTERM into a Ctrl-C
(:func:`bdsgd_cli.common.sigterm_as_ctrl_c`), and a scheduler that sends it to the whole process
group (a preemption) would otherwise kill the workers before the engine could stop them between
iterations. The launcher ends a worker that does not stop with SIGKILL. This module imports the
standard library alone, and the worker's spec comes pickled (unpickling it imports the worker
side: :mod:`bdsgd.stages.engine.worker`)."""

from __future__ import annotations

import importlib
import pickle
import signal


def run(target: str, spec: bytes) -> None:
    """Ignore SIGINT and SIGTERM, then call ``module:function`` ``target`` with the unpickled ``spec``
    (pickled by the engine that spawned this process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)(pickle.loads(spec))
