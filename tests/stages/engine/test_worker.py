"""A parameter-server worker's own decisions (bdsgd.stages.engine.worker), on an in-process
store."""

from __future__ import annotations

import torch.distributed as dist
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.worker import run_ended


def test_a_worker_left_behind_by_the_last_iteration_sees_that_the_run_ended():
    """The server announces the stop for the iteration after the last before it closes the
    group: a worker that then finds the group closed reads that and ends without failing; an
    announced next iteration, or none yet, is a real failure."""
    store = dist.HashStore()
    assert not run_ended(store, 19)  # nothing announced after iteration 19
    store.set(P.go_key(20), "3")  # a generation: iteration 20 runs
    assert not run_ended(store, 19)
    store.set(P.go_key(21), P.STOP)
    assert run_ended(store, 20) and not run_ended(store, 21)
