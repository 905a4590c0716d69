"""run_local's watch over the spawned ranks (stages/loop/local.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist
from bdsgd.stages.errors import WorkerError
from bdsgd.stages.loop.job import FAILURE_KEY
from bdsgd.stages.loop.local import watch


def _exited(code: int) -> SimpleNamespace:
    """A rank process that has already exited with ``code`` (a stand-in for mp.Process)."""
    return SimpleNamespace(exitcode=code, join=lambda timeout=None: None)


def test_a_rank_that_failed_is_reported_even_when_every_rank_exited_between_two_looks():
    # under load rank 1 fails and rank 0 (its group broken) exits before the watch looks again:
    # the failure must still be raised, with the failed rank's own line, not pass as a success
    store = dist.HashStore()
    store.set(FAILURE_KEY, "rank 1: RuntimeError: boom")
    with pytest.raises(WorkerError, match="rank 1: RuntimeError: boom"):
        watch([_exited(1), _exited(1)], store, 5.0, 5.0, lambda t, loss: None)


def test_ranks_that_all_succeeded_pass():
    watch([_exited(0), _exited(0)], dist.HashStore(), 5.0, 5.0, lambda t, loss: None)
