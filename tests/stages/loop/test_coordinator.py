"""The loop's coordinator on an in-process store: ranks are played by the test (tickets and
reports as a rank takes and writes them), so the cut, the censoring and the records are checked
without processes."""

from __future__ import annotations

import time

import numpy as np
import polars as pl
import pytest
import torch.distributed as dist
from bdsgd.stages.loop.config import LoopConfig
from bdsgd.stages.loop.coordinator import LoopCoordinator
from bdsgd.stages.policies.base import Policy
from bdsgd.stages.policies.driver import IterationDriver
from bdsgd.stages.store import TraceStore
from bdsgd.stages.wire import keys as P
from bdsgd.stages.wire.report import WorkerReport

WAIT_S = 60.0  # for the coordinator thread's cut, on a loaded machine


def arrive(store, t: int, worker: int, runtime: float, report: bool = True) -> P.Ticket:
    """A rank's arrival with its whole batch done, as ``Iteration._take_ticket`` makes it: the
    ticket, the close and cut if it holds an announced c, and the report, under a refused
    ticket too (``report=False``: left to :func:`report`)."""
    ticket = P.decode_ticket(store.add(P.ticket_key(t), 1))
    if not ticket.closed and ticket.number == ticket.limit:
        P.cut_at_limit(store, t, ticket.limit)
    if report:
        write_report(store, t, ticket.number, worker, runtime)
    return ticket


def write_report(store, t: int, number: int, worker: int, runtime: float) -> None:
    store.set(P.arrival_key(t, number), WorkerReport(worker, t, 0.0, runtime, 0.5, 0.0).encode())


def announced(store, t: int) -> int:
    """The c the coordinator announced for iteration t (waiting for it)."""
    deadline = time.monotonic() + WAIT_S
    while not (limit := P.decode_ticket(store.add(P.ticket_key(t), 0)).limit):
        assert time.monotonic() < deadline, f"no c announced for iteration {t}"
        time.sleep(0.001)
    return limit


def wait_cut(store, t: int) -> int:
    deadline = time.monotonic() + WAIT_S
    while not store.check([P.cut_key(t)]):
        assert time.monotonic() < deadline, f"no cut of iteration {t}"
        time.sleep(0.001)
    return int(store.get(P.cut_key(t)))


@pytest.fixture
def coordinator(tmp_path):
    store = dist.HashStore()
    cfg = LoopConfig(policy="static:2", traces=str(tmp_path / "traces"), out=str(tmp_path / "run"))
    coord = LoopCoordinator(cfg, store, 3, ["h0", "h1", "h2"], "run-x", "cpu")
    coord.start(time.perf_counter())
    yield coord, store
    coord.begins.put(None)


def test_static_cut_admits_the_first_two_tickets_and_censors_the_third(coordinator, tmp_path):
    """Rank 0 sees the cut between its micro-batches and stops (no ticket): censored at the
    cut in every iteration."""
    coord, store = coordinator
    for t in range(3):
        coord.begin(t, time.perf_counter())
        assert arrive(store, t, 2, 0.02).number == 1 and arrive(store, t, 1, 0.03).number == 2
        assert wait_cut(store, t) == 2
        coord.rank_values(t, end=time.perf_counter(), loss=0.5, lr=0.1)
    summary = coord.close(3)
    assert summary["iterations"] == 3 and summary["mean_c"] == 2.0
    assert summary["slow_ranks"][0]["rank"] == 0 and summary["slow_ranks"][0]["cut_share"] == 1.0
    rows = TraceStore(tmp_path / "traces").read().sort("iteration", "worker")
    assert rows.height == 9 and set(rows["cutoff"].to_list()) == {2}
    late = rows.filter(pl.col("worker") == 0)
    assert late["censored"].to_list() == [True] * 3
    assert all(r >= 0.03 for r in late["runtime_s"].to_list())  # censored at the cut
    assert not any(rows.filter(pl.col("worker") != 0)["censored"].to_list())
    assert rows.filter(pl.col("worker") == 1)["runtime_s"].to_list() == [0.03] * 3


def test_a_rank_that_finished_after_the_cut_is_not_admitted_but_not_censored(coordinator,
                                                                              tmp_path):  # fmt: skip
    """Rank 0 finished its whole batch just after the cut: its ticket is refused (its gradient
    is not among the c), but its run-time is exact, read once the ranks passed the
    all-reduce: its row is not censored, and the policy's c stays 2."""
    coord, store = coordinator
    coord.begin(0, time.perf_counter())
    arrive(store, 0, 2, 0.02)
    arrive(store, 0, 1, 0.03)
    assert wait_cut(store, 0) == 2
    assert arrive(store, 0, 0, 0.04).closed
    coord.rank_values(0, end=time.perf_counter(), loss=0.5)
    summary = coord.close(1)
    assert summary["mean_c"] == 2.0
    rows = TraceStore(tmp_path / "traces").read().sort("worker")
    assert rows["censored"].to_list() == [False, False, False]
    assert rows["runtime_s"].to_list() == [0.04, 0.03, 0.02] and set(rows["cutoff"]) == {2}


def test_a_ticket_taken_before_the_close_is_admitted_and_traced(coordinator, tmp_path):
    """Tickets race the close: whoever got a ticket below CLOSED is in the all-reduce, so the
    coordinator reads its report too, even past the policy's c."""
    coord, store = coordinator
    arrive(store, 0, 0, 0.01)
    arrive(store, 0, 1, 0.02)
    arrive(store, 0, 2, 0.03)  # all three before the coordinator even begins
    coord.begin(0, time.perf_counter())
    assert wait_cut(store, 0) == 3
    coord.rank_values(0, end=time.perf_counter(), loss=0.5)
    assert coord.close(1)["mean_c"] == 3.0
    rows = TraceStore(tmp_path / "traces").read()
    # every rank admitted, but the c the policy used is 2: the rows say so (null: awaited all)
    assert not any(rows["censored"].to_list()) and rows["cutoff"].to_list() == [2] * 3


def test_the_rank_holding_ticket_c_of_a_fixed_iteration_cuts_it(coordinator, tmp_path):
    """static:2 announces c = 2 in the counter; the rank that takes ticket 2 cuts and closes
    before its report is even written (so before the coordinator could), and a ticket taken
    after that close is refused, though it moved the counter: the coordinator admits the two."""
    coord, store = coordinator
    coord.begin(0, time.perf_counter())
    assert announced(store, 0) == 2
    assert arrive(store, 0, 2, 0.02) == P.Ticket(1, 2, False)
    assert arrive(store, 0, 1, 0.03, report=False) == P.Ticket(2, 2, False)
    assert store.check([P.cut_key(0)]) and int(store.get(P.closed_key(0))) == 2
    assert arrive(store, 0, 0, 0.5, report=False).closed
    write_report(store, 0, 2, 1, 0.03)
    write_report(store, 0, 3, 0, 0.5)  # (rank 0 finished after the cut: an exact run-time)
    coord.rank_values(0, end=time.perf_counter(), loss=0.5)
    assert coord.close(1)["mean_c"] == 2.0
    rows = TraceStore(tmp_path / "traces").read().sort("worker")
    assert rows["censored"].to_list() == [False, False, False]


class Scripted(Policy):
    """An online policy whose c is ``first`` before the iteration and ``revised`` from its first
    revision on (the revision the coordinator makes after reading the first reports)."""

    online = True

    def __init__(self, first: int, revised: int) -> None:
        self.first, self.revised, self.revisions = first, revised, 0

    def choose(self, live: np.ndarray) -> int:
        return self.first

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        pass

    def revise(self, now_s: float, runtimes: np.ndarray, arrived: np.ndarray) -> int:
        self.revisions += 1
        return self.revised


@pytest.fixture
def scripted(tmp_path):
    """A coordinator of 4 ranks driving a :class:`Scripted` policy (set ``coord.policy.first`` /
    ``revised`` before ``begin``), its timeout far beyond the test's waits."""
    store = dist.HashStore()
    cfg = LoopConfig(policy="ecdf:online", traces=None, timeout_s=10 * WAIT_S)
    coord = LoopCoordinator(cfg, store, 4, ["h0", "h1", "h2", "h3"], "run-s", "cpu")
    coord.policy = Scripted(3, 3)
    coord.driver = IterationDriver(coord.policy, 4)
    coord.start(time.perf_counter())
    yield coord, store
    coord.begins.put(None)
    coord.thread.join(WAIT_S)


def limit_becomes(store, t: int, limit: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while P.decode_ticket(store.add(P.ticket_key(t), 0)).limit != limit:
        assert time.monotonic() < deadline, f"iteration {t}'s c never stood at {limit}"
        time.sleep(0.001)


def coordinated(coord, t: int) -> dict:
    """What the coordinator recorded of iteration t, once it ended it (within the test's wait,
    far below its own timeout: a coordinator waiting for a report that never comes fails).
    The rank passes the iteration's all-reduce first: the coordinator ends it only then."""
    coord.rank_values(t, end=time.perf_counter())
    deadline = time.monotonic() + WAIT_S
    while t not in coord.coordinated:
        assert time.monotonic() < deadline, f"the coordinator never ended iteration {t}"
        time.sleep(0.001)
    return coord.coordinated[t]


def test_an_online_policy_announces_its_c_and_the_holder_of_that_ticket_cuts(tmp_path):
    store = dist.HashStore()
    cfg = LoopConfig(policy="ecdf:online", traces=None)
    coord = LoopCoordinator(cfg, store, 3, ["h0", "h1", "h2"], "run-o", "cpu")
    for _ in range(20):  # a third rank 100 times slower: waiting for it never pays
        coord.policy.observe(np.array([0.01, 0.01, 1.0]), np.zeros(3, dtype=bool))
    coord.start(time.perf_counter())
    try:
        coord.begin(0, time.perf_counter())
        c = announced(store, 0)
        assert coord.policy.online and c == coord.driver.chosen < 3
        tickets = [arrive(store, 0, w, x) for w, x in ((0, 0.01), (1, 0.01), (2, 1.0))[: c + 1]]
        assert tickets[c - 1] == P.Ticket(c, c, False) and tickets[c].closed  # ticket c cut
        assert wait_cut(store, 0) == c and int(store.get(P.closed_key(0))) == c
        coord.rank_values(0, end=time.perf_counter())  # (the rank passed the all-reduce)
    finally:
        coord.begins.put(None)
        coord.thread.join(WAIT_S)


def test_a_revision_to_every_rank_takes_the_standing_c_back(scripted):
    coord, store = scripted
    coord.policy.first, coord.policy.revised = 2, 4
    coord.begin(0, time.perf_counter())
    assert announced(store, 0) == 2
    arrive(store, 0, 0, 0.01)
    limit_becomes(store, 0, 0)  # revised to all four: no rank cuts
    assert [arrive(store, 0, w, 0.02).limit for w in (1, 2)] == [0, 0]
    assert not store.check([P.cut_key(0)])
    arrive(store, 0, 3, 0.03)
    assert wait_cut(store, 0) == 4 and coordinated(coord, 0)["c"] == 4


def test_a_revision_down_moves_the_cut_to_the_holder_of_the_lower_ticket(scripted):
    coord, store = scripted
    coord.policy.first, coord.policy.revised = 3, 2
    coord.begin(0, time.perf_counter())
    assert announced(store, 0) == 3
    arrive(store, 0, 0, 0.01)
    limit_becomes(store, 0, 2)
    assert arrive(store, 0, 1, 0.02) == P.Ticket(2, 2, False)  # it cut
    assert int(store.get(P.closed_key(0))) == 2 and arrive(store, 0, 2, 0.03).closed
    assert coordinated(coord, 0)["c"] == 2


def test_a_c_raised_after_its_holder_cut_ends_the_iteration_at_that_cut(scripted):
    """The holder of the standing c cut before the coordinator read a report; the revision
    then raised c: the coordinator takes the closed count, not a wait for tickets that were
    refused."""
    coord, store = scripted
    coord.policy.first, coord.policy.revised = 2, 3
    coord.begin(0, time.perf_counter())
    assert announced(store, 0) == 2
    arrive(store, 0, 0, 0.01, report=False)
    assert arrive(store, 0, 1, 0.02) == P.Ticket(2, 2, False)  # it cut and closed
    assert arrive(store, 0, 2, 0.03).closed
    write_report(store, 0, 1, 0, 0.01)
    assert coordinated(coord, 0)["c"] == 2 and coord.policy.revisions == 0  # (c arrived: unasked)


class Hooked:
    """The coordinator's view of a store: after its n-th read of iteration 0's ticket counter
    (``add(n/0, 0)``) the test's ``hooks[n]`` runs, so ranks act between that read and the
    coordinator's next call."""

    def __init__(self, store, hooks: dict) -> None:
        self.store, self.hooks, self.reads = store, hooks, 0

    def add(self, key: str, value: int) -> int:
        out = self.store.add(key, value)
        if key == P.ticket_key(0) and value == 0:
            self.reads += 1
            self.hooks.get(self.reads, lambda: None)()
        return out

    def clone(self) -> Hooked:  # (the coordinator's own connection: this view again)
        return self

    def __getattr__(self, name: str):
        return getattr(self.store, name)


def test_the_holder_of_an_earlier_c_cutting_between_a_count_and_its_reports_ends_the_iteration(
    tmp_path,
):
    """Ticket 3 was taken while c = 3 stood; the revision after ticket 1 took c to every rank.
    The coordinator's next count (3 taken, none closed) precedes that holder's cut, its read of
    reports 2..3 follows it: it must ask again, not wait for a fourth report that was refused."""
    store = dist.HashStore()

    def second_and_third_take_tickets():
        assert arrive(store, 0, 1, 0.02) == P.Ticket(2, 3, False)
        assert P.decode_ticket(store.add(P.ticket_key(0), 1)) == P.Ticket(3, 3, False)

    def third_cuts():
        P.cut_at_limit(store, 0, 3)
        write_report(store, 0, 3, 2, 0.03)

    hooked = Hooked(store, {1: second_and_third_take_tickets, 2: third_cuts})
    cfg = LoopConfig(policy="ecdf:online", traces=None, timeout_s=10 * WAIT_S)
    coord = LoopCoordinator(cfg, hooked, 4, ["h0", "h1", "h2", "h3"], "run-h", "cpu")
    coord.policy = Scripted(3, 4)
    coord.driver = IterationDriver(coord.policy, 4)
    coord.start(time.perf_counter())
    try:
        coord.begin(0, time.perf_counter())
        assert announced(store, 0) == 3
        arrive(store, 0, 0, 0.01)
        assert coordinated(coord, 0)["c"] == 3 and wait_cut(store, 0) == 3
        assert hooked.reads >= 3 and arrive(store, 0, 3, 0.04).closed
    finally:
        coord.begins.put(None)
        coord.thread.join(WAIT_S)


def test_the_report_names_the_slow_ranks_a_loop_found(coordinator, tmp_path):
    from bdsgd.stages.report import ReportConfig, run_report

    coord, store = coordinator
    for t in range(2):
        coord.begin(t, time.perf_counter())
        arrive(store, t, 2, 0.02)
        arrive(store, t, 1, 0.03)
        wait_cut(store, t)
        coord.rank_values(t, end=time.perf_counter(), loss=0.5)
    coord.close(2)
    run_report(ReportConfig(run_dirs=(tmp_path / "run",), out=tmp_path / "report"))
    index = (tmp_path / "report" / "index.md").read_text()
    assert "## Persistently slow ranks" in index and "rank 0 on `h0`" in index


def test_a_resumed_coordinator_feeds_its_policy_the_runs_earlier_iterations(tmp_path):
    """What the run observed before the checkpoint (its rows in the store) reaches the policy,
    the rows after it do not (they are run again)."""
    from tests.conftest import make_trace_rows

    TraceStore(tmp_path / "traces").append(make_trace_rows(iterations=6, workers=3, run_id="r"))
    cfg = LoopConfig(policy="ecdf", traces=str(tmp_path / "traces"))
    coord = LoopCoordinator(cfg, dist.HashStore(), 3, ["h0", "h1", "h2"], "new", "cpu")
    seen = []
    coord.policy.observe = lambda runtimes, censored: seen.append(runtimes.tolist())
    coord.resumed_at(4, "r")
    assert coord.replayed == 4 and seen == [[1.0, 2.0, 3.0]] * 4
    assert coord.run_id == "r" and coord.skip_through == 5


def test_ranks_all_cut_often_at_the_first_arrival_are_not_named_slow():
    from bdsgd.stages.loop.coordinator import slow_ranks

    runtimes = [np.full(4, 0.1) for _ in range(10)]
    hosts = ["h0", "h1", "h2", "h3"]
    every = [np.arange(4) != t % 4 for t in range(10)]  # three of four cut, in turn
    assert slow_ranks(runtimes, every, hosts, 4) == []
    one = [np.array([True, False, False, False]) for _ in range(10)]  # rank 0 cut every time
    assert [r["rank"] for r in slow_ranks(runtimes, one, hosts, 4)] == [0]
