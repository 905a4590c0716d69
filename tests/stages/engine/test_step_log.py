"""The coordinator's reading of the collective replicas' published steps."""

from __future__ import annotations

import threading
import types

import torch.distributed as dist
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.step_log import StepLog


def test_the_last_step_published_after_the_end_still_fills_its_rows_learning_rate():
    """Arrivals read live: the last row is recorded before its all-reduce publishes its step
    (a loaded machine); the end waits for that step, bounded, and the row gets its rate."""
    store = dist.HashStore()
    log = types.SimpleNamespace(rows={"iteration": [], "lr": [], "eval_loss": []})
    steps = StepLog(store, log, noise=None, batch_size=8)
    for t in range(2):
        lr = steps.lr_of(t)
        log.rows["iteration"].append(t)
        log.rows["lr"].append(lr)
    store.set(P.step_key(0), P.encode_step((), b"", lr=0.25))
    late = threading.Timer(0.5, store.set, (P.step_key(1), P.encode_step((), b"", lr=0.125)))
    late.start()
    try:
        steps.collect_evals(2, online=True, wait_s=60)
    finally:
        late.join(60)
    assert log.rows["lr"] == [0.25, 0.125]
    assert not store.check([P.step_key(0)]) and not store.check([P.step_key(1)])  # (read: gone)


def test_a_step_that_never_comes_leaves_its_row_empty_after_the_bounded_wait():
    store = dist.HashStore()
    log = types.SimpleNamespace(rows={"iteration": [0], "lr": [None], "eval_loss": [None]})
    steps = StepLog(store, log, noise=None, batch_size=8)
    steps.pending_lrs[0] = 0
    steps.collect_evals(1, online=True, wait_s=0.2)
    assert log.rows["lr"] == [None]
