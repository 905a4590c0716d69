"""A process group that outlives ``destroy_process_group`` aborts its process at exit.

``torch.distributed.nn.functional`` declares its collectives with ``group=group.WORLD`` as a
default argument, evaluated once, when the module is imported. Imported before
``init_process_group`` the defaults are None (the default group, looked up at each call).
Imported after it, each of those defaults holds the default process group itself. An ordinary
training script imports it after: the first ``torch.optim`` optimizer it builds imports
``torch._dynamo``, which imports ``torch._inductor`` and, through it, ``torch.distributed.nn``.

The group then survives ``destroy_process_group``, and so do its gloo threads. At exit they race
the interpreter's teardown, and the process dies of SIGABRT ("terminate called without an active
exception") after its work is done. With gloo, 15 of 20 five-rank runs of a script that gathers
once and exits died this way here; none did with the module imported before the group.

:func:`release_default_group` hands the defaults back to None: the same group, looked up at call
time. :meth:`bdsgd.Cutoff.close` calls it, so a script that closes its ``Cutoff`` before
``destroy_process_group`` releases its group whatever it imported when.
"""

from __future__ import annotations

import sys
import types

import torch.distributed as dist

FUNCTIONAL = "torch.distributed.nn.functional"


def release_default_group() -> int:
    """Replace every default argument of :data:`FUNCTIONAL`'s functions that holds the current
    default process group with None; returns how many it replaced."""
    group, functions = _holders()
    replaced = 0
    for fn in functions:
        replaced += sum(d is group for d in fn.__defaults__)
        fn.__defaults__ = tuple(None if d is group else d for d in fn.__defaults__)
    return replaced


def held_defaults() -> int:
    """How many default arguments of :data:`FUNCTIONAL`'s functions hold the current default
    process group (0 when the module is not loaded or no group is initialised)."""
    group, functions = _holders()
    return sum(d is group for fn in functions for d in fn.__defaults__)


def _holders() -> tuple[object, list]:
    """The default group and :data:`FUNCTIONAL`'s functions with a default argument that holds
    it (none when the module is not loaded or no group is initialised)."""
    module = sys.modules.get(FUNCTIONAL)
    if module is None or not dist.is_initialized():
        return None, []
    group = dist.group.WORLD
    functions = [fn for fn in vars(module).values() if isinstance(fn, types.FunctionType)]
    return group, [fn for fn in functions if any(d is group for d in fn.__defaults__ or ())]
