"""The coordinator's reading of the collective replicas' published steps."""

from __future__ import annotations

import threading
import types

import numpy as np
import torch.distributed as dist
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.announcer import Announcer
from bdsgd.stages.engine.progress import Progress
from bdsgd.stages.engine.regroup import Regrouping
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


def rows_of(steps: StepLog, log, iterations: range) -> None:
    for t in iterations:
        lr = steps.lr_of(t)
        log.rows["iteration"].append(t)
        log.rows["lr"].append(lr)


def test_a_step_read_live_that_is_late_by_two_iterations_is_waited_for_not_skipped():
    """A loaded machine: the lowest replica publishes step 0 only after the fast replicas
    reported iteration 1 (the coordinator begins iteration 2). Step 0 is read when it comes,
    step 1 after it, and both rows get their rates (a skip took 0 for failed and dropped it)."""
    store = dist.HashStore()
    log = types.SimpleNamespace(rows={"iteration": [], "lr": [], "eval_loss": []})
    steps = StepLog(store, log, noise=None, batch_size=8)
    rows_of(steps, log, range(2))
    store.set(P.step_key(1), P.encode_step((), b"", lr=0.125))
    steps.read_through(2, online=True)
    assert steps.next == 0 and log.rows["lr"] == [None, None]  # step 0 not there: none read
    store.set(P.step_key(0), P.encode_step((), b"", lr=0.25))
    rows_of(steps, log, range(2, 3))
    steps.read_through(3, online=True)
    assert steps.next == 2 and log.rows["lr"] == [0.25, 0.125, None]


def test_a_step_read_live_before_a_regroupings_resume_is_skipped_once_its_members_joined():
    """Step 1's all-reduce failed; the new generation (2 members) resumed at 2. Until both
    joined, step 1 may still come (a slow lowest replica publishes before it joins); once they
    have, it never will: skipped, and step 2 read."""
    store = dist.HashStore()
    log = types.SimpleNamespace(rows={"iteration": [], "lr": [], "eval_loss": []})
    steps = StepLog(store, log, noise=None, batch_size=8)
    rows_of(steps, log, range(3))
    store.set(P.step_key(0), P.encode_step((), b"", lr=0.25))
    store.set(P.step_key(2), P.encode_step((), b"", lr=0.5))
    steps.read_through(3, online=True)
    assert steps.next == 1  # step 1 may yet come
    steps.regrouped(2, generation=1, members=2)
    store.add(P.joined_key(1), 1)
    steps.read_through(3, online=True)
    assert steps.next == 1  # one member has not joined: its step 1 may come
    store.add(P.joined_key(1), 1)
    steps.read_through(3, online=True)
    assert steps.next == 3 and log.rows["lr"] == [0.25, None, 0.5]


def test_a_step_published_as_its_member_joined_is_read_not_skipped():
    """The lowest replica publishes step 1, then joins, between the coordinator's first look
    for step 1 and its count of the joined: the second look finds it."""
    store = dist.HashStore()
    log = types.SimpleNamespace(rows={"iteration": [], "lr": [], "eval_loss": []})
    steps = StepLog(store, log, noise=None, batch_size=8)
    rows_of(steps, log, range(2))
    store.set(P.step_key(0), P.encode_step((), b"", lr=0.25))
    steps.regrouped(2, generation=1, members=1)
    count = steps.lost

    def publish_then_count(k, t, online):
        store.set(P.step_key(1), P.encode_step((), b"", lr=0.125))
        store.add(P.joined_key(1), 1)
        return count(k, t, online)

    steps.lost = publish_then_count
    steps.read_through(2, online=True)
    assert steps.next == 2 and log.rows["lr"] == [0.25, 0.125]


def test_a_regrouping_found_while_admitting_tells_the_step_log_where_it_resumed():
    """Arrivals read live, iteration 5 being admitted when a member fails: the new generation
    of the two live replicas resumes at 6, and the coordinator's step log learns it (with the
    generation to count the joined of), so step 5 is not waited for once they joined."""
    store = dist.HashStore()
    store.set(P.STATES_KEY, "0")  # (no run directory)
    log = types.SimpleNamespace(rows={"iteration": [], "lr": [], "eval_loss": []})
    engine = types.SimpleNamespace(
        c10d=store,
        progress=Progress(begun=5, announced=5, admitting=5),
        announcer=Announcer(store, record_batch=4, record_clock=lambda: False),
        reads_arrivals=True,
        live=np.array([True, False, True]),
        steps=StepLog(store, log, noise=None, batch_size=8),
    )
    engine.new_generation = lambda resume: engine.announcer.new_generation(engine.live, resume)
    Regrouping(engine).regroup()
    assert engine.progress.aborted and engine.steps.resumed_at == 6
    generation = engine.announcer.generation
    assert engine.steps.joining == (generation, 2)
    assert store.get(P.generation_key(generation)).decode().endswith(";6")
