"""The per-node relay of the cut: when it is on, and that it passes each iteration's cut from
the job's store to the node-local one in order, keeping only the last few."""

from __future__ import annotations

import pytest
from bdsgd.stages.loop.relay import KEEP, CutRelay, wants_relay
from bdsgd.stages.wire import keys as P

WAIT_S = 60.0  # generous: a loaded machine may be slow, never wrong
SLICE_S = 0.2  # the relay's waits here: short, so that it sees its stop and its rank's moves


def test_auto_relays_only_when_a_job_spans_hosts_that_run_several_ranks() -> None:
    assert wants_relay(None, ["a", "a", "b", "b"])
    assert not wants_relay(None, ["a", "a", "a"])  # one host: its store is local already
    assert not wants_relay(None, ["a", "b", "c"])  # one rank per host: nothing to share
    assert wants_relay(True, ["a"]) and not wants_relay(False, ["a", "a", "b", "b"])


@pytest.fixture
def stores():
    job = P.open_store("127.0.0.1", 0, True, WAIT_S)
    local = P.open_store("127.0.0.1", 0, True, WAIT_S)
    yield job, local


def test_the_relay_passes_each_cut_on_in_order_and_forgets_old_ones(stores) -> None:
    job, local = stores
    relay = CutRelay(job, local.port, lambda: 0,
                     WAIT_S, wait_s=SLICE_S)  # fmt: skip
    try:
        assert not local.check([P.cut_key(0)])
        for t in range(KEEP + 2):
            job.set(P.cut_key(t), str(t))
            assert P.wait_key(local, P.cut_key(t), WAIT_S), f"cut {t} not relayed"
        assert relay.relayed == KEEP + 2
        assert not local.check([P.cut_key(0)]) and not local.check([P.cut_key(1)])
        assert local.check([P.cut_key(t) for t in range(2, KEEP + 2)])
    finally:
        relay.close()
    assert not relay.thread.is_alive()


def test_the_relay_follows_its_rank_past_iterations_it_missed(stores) -> None:
    job, local = stores
    now = [5]  # the rank is at iteration 5 (resumed, or its delay outran cuts 0-4)
    relay = CutRelay(job, local.port,
                     lambda: now[0], WAIT_S, wait_s=SLICE_S)  # fmt: skip
    try:
        job.set(P.cut_key(5), "5")
        assert P.wait_key(local, P.cut_key(5), WAIT_S)
        job.set(P.cut_key(3), "3")  # an old cut appearing late is not waited for
        now[0] = 7
        job.set(P.cut_key(7), "7")
        assert P.wait_key(local, P.cut_key(7), WAIT_S)
        assert not local.check([P.cut_key(3)]) and not local.check([P.cut_key(6)])
    finally:
        relay.close()


def test_a_node_whose_relay_did_not_start_looks_in_the_job_store(stores) -> None:
    from bdsgd.stages.loop.relay import NO_RELAY, NodeCut

    job, _ = stores
    off = NodeCut(job, ["a", "a"], 1, False, lambda: 0, WAIT_S)
    assert off.view is job and off.relay is None
    job.set("relay/0", NO_RELAY)  # rank 0 of host "a" could not host the local store
    fallback = NodeCut(job, ["a", "a"], 1, True, lambda: 0, WAIT_S)
    assert fallback.view is job and fallback.relay is None
    first = NodeCut(job, ["b", "b"], 0, True, lambda: 0, WAIT_S)  # this one can: it relays
    try:
        assert first.view is first.server and first.relay is not None
        job.set(P.cut_key(0), "1")
        assert P.wait_key(first.view, P.cut_key(0), WAIT_S)
    finally:
        first.close()  # its relay waits (up to 30 s) for cut 1: the close ends that wait
    assert not first.relay.thread.is_alive()
