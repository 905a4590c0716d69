"""The control plane at scale: N emulated ranks against a real c10d TCPStore and a real
coordinator, no model.

    python -m benchmarks.control_plane --ranks 1024 --quick --json
    python -c "from benchmarks.control_plane import run; print(run())"     # the table (make bench)

Each iteration follows the cutoff protocol of the engines (``bdsgd.stages.wire.keys``)
and of the training-loop library: the coordinator announces iteration t (``go/<t>``); every
rank waits its drawn run-time (ended early by the cut, as an engine's injected delay is), then
takes a ticket (``store.add("n/<t>", 1)``; below CLOSED it is admitted) and writes its report
under ``a/<t>/<ticket>``; the coordinator reads the reports in ticket order, hands each to the
:class:`IterationDriver` (which asks the policy), and at the cut closes the counter (adds
CLOSED) and sets ``cut/<t>``, then reads the reports of whoever took a ticket meanwhile. Every
rank then waits for the cut.

Ranks are threads, each with its own store client (its own connection, as a rank has), spread
over a few processes; the store and the coordinator live in this process. Measured per
iteration: the time from the c-th arrival (ticket c taken) to the cut visible to every rank,
the store round trips, and the CPU time of the coordinator's thread and of the store's server.

Two ways the protocol can travel (``--mode``):

- ``direct``: the coordinator reads one report per round trip; every rank waits for the cut
  on the store itself (N waiters on one key).
- ``batched``: the keys and their meaning are the same; the coordinator reads the ticket
  counter after each report and fetches every report already taken in one ``multi_get``; one
  relay per node (a process of its own) waits for the cut on the store, and the node wakes its
  ranks locally.
- ``fixed``: ``batched``, and the coordinator announces the iteration's c in the ticket
  counter (``protocol.announce_limit``, as the training-loop library does): the rank that
  takes ticket c sets the cut itself, then closes the counter (``protocol.cut_at_limit``). An
  online policy's (``--policy``, e.g. ``ewma:online``) revisions move the announced c
  (``protocol.move_limit``): its c stands until revised, as in the library since 2026-11-28.

The policy is ``static:C`` (C = ``c_frac`` of the ranks: the decision costs nothing, the figures
are the control plane's) unless ``--policy`` names another.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
from bdsgd.stages.wire import keys as P

MODES = ("direct", "batched", "fixed")
WARMUP = 2  # first iterations left out of the figures (connections and threads warming up)
START_TIMEOUT_S = 300.0  # rank processes import torch and connect N clients (slow when loaded)
STEP_TIMEOUT_S = 60.0  # any single wait on another process


@dataclass(frozen=True)
class Setup:
    """One emulated cluster."""

    ranks: int = 64
    iterations: int = 50
    procs: int = 4  # processes the rank threads are spread over ("nodes")
    mode: str = "direct"
    base_s: float = 0.05  # median run-time
    sigma: float = 0.1  # log-normal spread of run-times
    p_slow: float = 0.03  # chance a rank is a straggler in an iteration
    slow_factor: float = 3.0
    c_frac: float = 0.9  # the policy waits for this share of the ranks (static:C)
    policy: str = ""  # a policy spec; "" for static:C
    seed: int = 0
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.ranks < 2 or self.iterations <= WARMUP or self.procs < 1:
            raise ValueError("need ranks >= 2, iterations > 2, procs >= 1")

    @property
    def cutoff(self) -> int:
        return max(1, min(self.ranks, round(self.c_frac * self.ranks)))


def draw_runtimes(setup: Setup) -> np.ndarray:
    """(iterations, ranks) run-times: log-normal around ``base_s``, stragglers slowed down."""
    rng = np.random.default_rng(setup.seed)
    shape = (setup.iterations, setup.ranks)
    x = setup.base_s * np.exp(setup.sigma * rng.standard_normal(shape))
    return x * np.where(rng.random(shape) < setup.p_slow, setup.slow_factor, 1.0)


class CountingStore:
    """A store client that counts its round trips (every call is one)."""

    def __init__(self, store) -> None:
        self.store, self.trips = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.trips += 1
            return method(*args, **kwargs)

        return counted


def timeout(seconds: float = STEP_TIMEOUT_S) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def done_key(t: int, proc: int) -> str:
    """The harness's: process ``proc``'s ranks have all seen iteration t's cut."""
    return f"bench/done/{t}/{proc}"


def ready_key(proc: int) -> str:
    return f"bench/ready/{proc}"


# -- the ranks --------------------------------------------------------------------------------
class Cut:
    """How a rank learns of iteration t's cut: on the store itself (``direct``), or from its
    node's relay, which waits on the store once for all of them (``batched``, ``fixed``).

    The relay is a process of its own (:func:`relay_process`), as the node's first rank is in
    the training-loop library: in the emulation's node process it would share the GIL with the
    node's hundreds of rank threads and see the cut only when Python handed it over (every
    5 ms). It sends (t, when it saw the cut) down a pipe; :meth:`relay` takes that in the node
    process and wakes the ranks (``direct``: the ranks wait on the store themselves; the relay
    is one more waiter, for the measurement)."""

    def __init__(self, setup: Setup, conn) -> None:
        self.relayed = setup.mode != "direct"
        self.conn = conn  # the relay process's end: (t, when the relay saw cut/<t>)
        self.event = threading.Event()

    def relay(self, t: int, seen: list[float]) -> None:
        """The node process's part of iteration t (its own thread): the relay's word that the
        cut is in (``seen[t]``: when the relay saw it), then wake the ranks."""
        if not self.conn.poll(STEP_TIMEOUT_S):
            raise TimeoutError(f"no word from the relay of iteration {t}'s cut")
        got, seen[t] = self.conn.recv()
        if got != t:
            raise RuntimeError(f"the relay saw iteration {got}'s cut, expected {t}")
        self.event.set()

    def reset(self) -> None:
        self.event.clear()

    def wait(self, client: CountingStore, t: int, seconds: float | None) -> bool:
        """Whether the cut is seen within ``seconds`` (None: it must be; it comes)."""
        if self.relayed:
            return self.event.wait(STEP_TIMEOUT_S if seconds is None else seconds)
        return P.wait_key(client, P.cut_key(t), STEP_TIMEOUT_S if seconds is None else seconds)


def relay_process(setup: Setup, port: int, conn) -> None:
    """A node's relay: its own store client waits for each iteration's cut in turn and sends
    (t, when it came) to the node's rank process. Ends after the last iteration, or at a wait
    that times out (the node process then times out too, and says so)."""
    store = P.open_store(setup.host, port, False, STEP_TIMEOUT_S)
    conn.send((-1, time.perf_counter()))  # connected
    for t in range(setup.iterations):
        store.wait([P.cut_key(t)], timeout(START_TIMEOUT_S if t == 0 else STEP_TIMEOUT_S))
        conn.send((t, time.perf_counter()))
    conn.close()


def rank_iteration(client: CountingStore, cut: Cut, w: int, t: int, runtime: float) -> tuple:
    """One rank, one iteration: (ticket or 0, when it was taken, when the cut was seen, when
    this rank set the cut or NaN) -- the rank that takes an announced c closes and cuts, as
    ``Iteration._take_ticket`` of the training-loop library does."""
    start, cut_set = time.perf_counter(), np.nan
    if cut.wait(client, t, runtime):  # cut before its gradient was ready
        return 0, np.nan, time.perf_counter(), cut_set
    ticket = P.decode_ticket(client.add(P.ticket_key(t), 1))
    taken = time.perf_counter()
    if not ticket.closed:
        if ticket.number == ticket.limit:  # (protocol.cut_at_limit, timed after the cut)
            client.set(P.cut_key(t), str(ticket.limit))
            cut_set = time.perf_counter()
            client.set(P.closed_key(t), str(P.close_tickets(client, t)[0]))
        client.set(P.arrival_key(t, ticket.number), f"{w},{runtime!r},{start!r}")
    if not cut.wait(client, t, None):
        raise TimeoutError(f"rank {w}: no cut of iteration {t}")
    return ticket.number if not ticket.closed else 0, taken, time.perf_counter(), cut_set


def rank_thread(setup: Setup, port: int, cut, w, draws, gates, out, clients) -> None:
    """Rank w: its own store client (opened here, concurrently with the other ranks'), then
    every iteration; ``out[k]`` holds (ticket, taken, seen) of iteration k. A failure elsewhere
    breaks the gates, and the rank ends quietly (the process reports it)."""
    client = CountingStore(P.open_store(setup.host, port, False, STEP_TIMEOUT_S))
    clients.append(client)
    try:
        gates[0].wait(START_TIMEOUT_S)  # every rank connected
        for t, runtime in enumerate(draws):
            gates[0].wait(STEP_TIMEOUT_S)
            out[t] = rank_iteration(client, cut, w, t, float(runtime))
            gates[1].wait(STEP_TIMEOUT_S)
    except threading.BrokenBarrierError:
        return


def rank_process(setup: Setup, port: int, proc: int, ranks: list[int], results) -> None:
    """One "node": a thread per rank, each with its own store client, an agent that starts
    every iteration for them, and the node's relay (a process, :class:`Cut`)."""
    threading.stack_size(512 * 1024)
    agent = P.open_store(setup.host, port, False, STEP_TIMEOUT_S)
    here, there = mp.get_context("spawn").Pipe(duplex=False)
    relay = mp.get_context("spawn").Process(  # (daemon: ends with its node's process)
        target=relay_process, args=(setup, port, there), daemon=True
    )
    relay.start()
    there.close()
    cut = Cut(setup, here)
    gates = (threading.Barrier(len(ranks) + 1), threading.Barrier(len(ranks) + 1))
    outs, clients = [[None] * setup.iterations for _ in ranks], []
    node_seen = [np.nan] * setup.iterations
    draws = draw_runtimes(setup)
    for w, out in zip(ranks, outs, strict=True):
        args = (setup, port, cut, w, draws[:, w], gates, out, clients)
        threading.Thread(target=rank_thread, args=args, daemon=True).start()
    try:
        gates[0].wait(START_TIMEOUT_S)
        if not here.poll(START_TIMEOUT_S):  # the relay connected
            raise TimeoutError(f"node {proc}: its relay did not connect")
        here.recv()
        agent.set(ready_key(proc), "1")
        for t in range(setup.iterations):
            agent.wait([P.go_key(t)], timeout(START_TIMEOUT_S if t == 0 else STEP_TIMEOUT_S))
            node_iteration(cut, gates, t, node_seen)
            agent.set(done_key(t, proc), "1")
    finally:
        for gate in gates:
            gate.abort()
        reap([relay])
    trips = sum(c.trips for c in clients)
    results.put((proc, ranks, np.array(outs, dtype=float), np.array(node_seen), trips))


def node_iteration(cut: Cut, gates, t: int, node_seen: list[float]) -> None:
    """Start iteration t on the node's ranks; the relay waits for its cut meanwhile."""
    cut.reset()
    relay = threading.Thread(target=cut.relay, args=(t, node_seen), daemon=True)
    relay.start()
    gates[0].wait(STEP_TIMEOUT_S)
    gates[1].wait(STEP_TIMEOUT_S)
    relay.join(STEP_TIMEOUT_S)


# -- the coordinator --------------------------------------------------------------------------
class Coordinator:
    """Decides each iteration's cut as the engines do: reports in ticket order through the
    :class:`IterationDriver`, then close, cut, and read who took a ticket meanwhile."""

    def __init__(self, setup: Setup, store) -> None:
        from bdsgd.stages.policies.driver import IterationDriver
        from bdsgd.stages.policies.registry import make_policy

        self.setup, self.store = setup, CountingStore(store)
        policy = make_policy(setup.policy or f"static:{setup.cutoff}", setup.ranks)
        self.driver = IterationDriver(policy, setup.ranks)
        self.batched = setup.mode != "direct"
        self.fixed = setup.mode == "fixed"
        self.standing = P.StandingC(setup.ranks)  # the c announced in the iteration's counter

    def iteration(self, t: int) -> tuple[int, int, float]:
        """Iteration t's admission: the c it ended at, the tickets admitted (a batch read
        admits every ticket in it) and when it set the cut (NaN: the rank holding ticket c did). ``fixed``: c is announced before the iteration starts, and moved
        after each revision of an online policy."""
        self.driver.begin(np.ones(self.setup.ranks, dtype=bool))
        self.standing.begin()
        self.stand(t)
        ticket, c, held = 1, 0, False
        while not (c or held):
            reports, closed = self.read(t, ticket)
            c = self.hand_over(reports, ticket)
            first, ticket = ticket, ticket + len(reports)
            # the holder of a c that stood then cut: every admitted report is read below
            held = not c and (closed or self.holder_cut(t, first, ticket - 1) or self.stand(t))
        (total, first), cut_at = P.close_tickets(self.store, t), np.nan
        if first:
            self.store.set(P.cut_key(t), str(total))
            cut_at = time.perf_counter()
        else:
            total = self.closed_at(t)
        late = self.read_many(t, ticket, total) if total >= ticket else []
        self.hand_over(late, ticket)
        self.driver.end()
        return (total if held else c), total, cut_at

    def stand(self, t: int) -> bool:
        """``fixed``: announce the driver's c in iteration t's counter, or move it there;
        whether the counter was closed then (as ``LoopCoordinator._stand``)."""
        return self.fixed and self.standing.move(self.store, t, self.driver.target)

    def holder_cut(self, t: int, first: int, last: int) -> bool:
        """Whether the holder of a c that stood cut (``protocol.StandingC.held_cut``)."""
        return self.standing.held_cut(self.store, t, first, last, STEP_TIMEOUT_S)

    def read(self, t: int, ticket: int) -> tuple[list[bytes], bool]:
        """The report of ``ticket`` (waiting for it), and, batched, every later one taken;
        whether a rank closed the counter (every report admitted is then among them)."""
        first = self.store.get(P.arrival_key(t, ticket))
        if not self.batched:
            return [first], False
        taken, closed = P.tickets_admitted(self.store, t, STEP_TIMEOUT_S)
        taken = counted(t, taken)
        reports = [first, *self.read_many(t, ticket + 1, taken)] if taken > ticket else [first]
        return reports, closed

    def closed_at(self, t: int) -> int:
        """The tickets admitted when the rank holding ticket c closed the counter."""
        return counted(t, P.closed_count(self.store, t, STEP_TIMEOUT_S))

    def read_many(self, t: int, first: int, last: int) -> list[bytes]:
        keys = [P.arrival_key(t, k) for k in range(first, last + 1)]
        if self.batched:
            return self.store.multi_get(keys)
        return [self.store.get(k) for k in keys]

    def hand_over(self, reports: list[bytes], first: int) -> int:
        """The reports read together (tickets ``first`` on) to the driver in ticket order, an
        online policy revised once, at the last (``IterationDriver.arrive_all``, as the
        library's coordinator does): the ticket that ended the iteration, or 0. Read one by one
        (``direct``), a static c ends at its own ticket."""
        if not reports:
            return 0
        arrivals = [blob.decode().split(",")[:2] for blob in reports]
        if not self.driver.arrive_all([(int(w), float(runtime)) for w, runtime in arrivals]):
            return 0
        return min(max(self.driver.target, first), first + len(reports) - 1)  # c, if read now


def counted(t: int, count: int | None) -> int:
    if count is None:
        raise TimeoutError(f"no count of iteration {t}'s tickets from the rank that closed it")
    return count


def coordinate(setup: Setup, store, coordinator: Coordinator) -> dict:
    """Run every iteration: announce, admit, cut, wait for every process to have seen it."""
    c, admitted, cut_at, cpu = (np.zeros(setup.iterations) for _ in range(4))
    for t in range(setup.iterations):
        tic = time.thread_time()
        store.set(P.go_key(t), "0")
        c[t], admitted[t], cut_at[t] = coordinator.iteration(t)
        cpu[t] = time.thread_time() - tic
        store.wait([done_key(t, p) for p in range(setup.procs)], timeout())
    return {"c": c, "admitted": admitted, "cut_at": cut_at, "cpu": cpu}


# -- one run ----------------------------------------------------------------------------------
def measure(setup: Setup) -> dict:
    """Start the store and the rank processes, run the iterations, reap, summarise."""
    P.quiet_c10d_logs()
    store = P.open_store(setup.host, 0, True, STEP_TIMEOUT_S)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    shares = np.array_split(np.arange(setup.ranks), setup.procs)
    procs = [
        ctx.Process(target=rank_process, args=(setup, store.port, p, s.tolist(), results))
        for p, s in enumerate(shares)
    ]
    for proc in procs:
        proc.start()
    try:
        tic = time.perf_counter()
        store.wait([ready_key(p) for p in range(setup.procs)], timeout(START_TIMEOUT_S))
        print(f"{setup.ranks} ranks ready in {time.perf_counter() - tic:.1f}s", file=sys.stderr)
        coordinator = Coordinator(setup, store)
        cpu0 = time.process_time() - time.thread_time()
        coord = coordinate(setup, store, coordinator)
        server_cpu = time.process_time() - time.thread_time() - cpu0
        ranks = collect(setup, results)
    finally:
        reap(procs)
    return summarise(setup, coord, ranks, coordinator.store.trips, server_cpu)


def collect(setup: Setup, results) -> dict:
    """Every process's (ticket, taken, seen) per rank and iteration, and its round trips."""
    out = np.zeros((setup.iterations, setup.ranks, 4))
    nodes = np.zeros((setup.iterations, setup.procs))
    trips = 0
    for _ in range(setup.procs):
        try:
            proc, ranks, arr, node_seen, n = results.get(timeout=STEP_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError("a rank process sent no results") from None
        out[:, ranks, :] = arr.transpose(1, 0, 2)
        nodes[:, proc] = node_seen
        trips += n
    taken, seen, cut_set = out[..., 1], out[..., 2], out[..., 3]
    return {"ticket": out[..., 0], "taken": taken, "seen": seen, "cut_set": cut_set,
            "nodes": nodes, "trips": trips}  # fmt: skip


def reap(procs) -> None:
    for proc in procs:
        proc.join(STEP_TIMEOUT_S)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def summarise(setup: Setup, coord: dict, ranks: dict, coord_trips: int, server_cpu: float) -> dict:
    """Per iteration: the c-th arrival (ticket c taken) to the last rank seeing the cut, and
    to the coordinator setting it; medians and 99th percentiles over the measured ones. Where a
    rank cut, c is its ticket (the c that stood: tickets taken before its close are admitted
    too, so an online iteration can admit more)."""
    keep = slice(WARMUP, None)
    c = cut_tickets(coord["c"].astype(int), ranks)
    cth = np.array([ranks["taken"][t][ranks["ticket"][t] == c[t]][0] for t in range(len(c))])
    visible = (ranks["seen"].max(axis=1) - cth)[keep] * 1e3
    by_rank = np.min(np.where(np.isnan(ranks["cut_set"]), np.inf, ranks["cut_set"]), axis=1)
    cut_at = np.where(np.isnan(coord["cut_at"]), by_rank, coord["cut_at"])
    decided = (cut_at - cth)[keep] * 1e3
    at_nodes = (ranks["nodes"].max(axis=1) - cth)[keep] * 1e3
    t = setup.iterations
    return {
        "ranks": setup.ranks,
        "mode": setup.mode,
        "policy": setup.policy or f"static:{setup.cutoff}",
        "procs": setup.procs,
        "iterations": t - WARMUP,
        "mean_c": round(float(c[keep].mean()), 1),
        "mean_admitted": round(float(coord["admitted"][keep].mean()), 1),
        "cut_visible_ms_p50": pct(visible, 50),
        "cut_visible_ms_p99": pct(visible, 99),
        "cut_at_nodes_ms_p50": pct(at_nodes, 50),
        "cut_at_nodes_ms_p99": pct(at_nodes, 99),
        "cut_set_ms_p50": pct(decided, 50),
        "cut_set_ms_p99": pct(decided, 99),
        "store_round_trips_per_iteration": round((ranks["trips"] + coord_trips) / t, 1),
        "coordinator_round_trips_per_iteration": round(coord_trips / t, 1),
        "coordinator_cpu_ms_per_iteration": round(float(np.median(coord["cpu"][keep])) * 1e3, 3),
        "store_server_cpu_ms_per_iteration": round(server_cpu / t * 1e3, 3),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def cut_tickets(admitted: np.ndarray, ranks: dict) -> np.ndarray:
    """Per iteration, the ticket of the rank that set the cut, or (the coordinator cut) the
    number of tickets admitted."""
    cut_by = ~np.isnan(ranks["cut_set"])
    return np.array([ranks["ticket"][t][cut_by[t]][0] if cut_by[t].any() else admitted[t]
                     for t in range(len(admitted))])  # fmt: skip


def pct(values: np.ndarray, q: float) -> float:
    return round(float(np.percentile(values, q)), 3)


# -- the table (make bench) and the command ---------------------------------------------------
SIZES = (64, 256, 1024)


ONLINE = "ewma:online"  # the online policy of the table's last rows (its revisions cost little)


def run(quick: bool = False) -> str:
    """Markdown: every mode at 64, 256 and 1,024 ranks with a static c, then an online policy
    at the largest size through the coordinator (``batched``) and standing (``fixed``)."""
    sizes = SIZES[:2] if quick else SIZES
    rows = [measure(default_setup(ranks, quick, mode)) for ranks in sizes for mode in MODES]
    for mode in ("batched", "fixed"):
        setup = default_setup(sizes[-1], quick, mode)
        rows.append(measure(Setup(**{**asdict(setup), "policy": ONLINE})))
    return render(rows)


def default_setup(ranks: int, quick: bool, mode: str, iterations: int | None = None) -> Setup:
    procs = max(1, min(4, ranks // 32))
    return Setup(ranks=ranks, iterations=iterations or (20 if quick else 60), procs=procs,
                 mode=mode)  # fmt: skip


COLUMNS = (
    ("ranks", "ranks"),
    ("mode", "mode"),
    ("policy", "policy"),
    ("mean_c", "mean c"),
    ("cut_visible_ms_p50", "cut visible p50 ms"),
    ("cut_visible_ms_p99", "p99 ms"),
    ("cut_at_nodes_ms_p50", "cut at every node p50 ms"),
    ("cut_at_nodes_ms_p99", "p99 ms"),
    ("cut_set_ms_p50", "cut set p50 ms"),
    ("cut_set_ms_p99", "p99 ms"),
    ("store_round_trips_per_iteration", "round trips / it"),
    ("coordinator_round_trips_per_iteration", "of them the coordinator's"),
    ("coordinator_cpu_ms_per_iteration", "coordinator CPU ms / it"),
    ("store_server_cpu_ms_per_iteration", "store server CPU ms / it"),
    ("load_average_1m", "load"),
)


def render(rows: list[dict]) -> str:
    setup = Setup()
    lines = [
        "## Control plane at scale (`benchmarks/control_plane.py`)",
        "",
        f"Emulated ranks (threads with a store client each, over up to 4 processes) against one "
        f"c10d TCPStore on loopback and the coordinator (static c = {setup.c_frac:.0%} of N); "
        f"run-times log-normal around {setup.base_s * 1e3:g} ms (spread {setup.sigma}), "
        f"{setup.p_slow:.0%} stragglers x{setup.slow_factor:g}. `cut visible`: from the c-th "
        "ticket taken to the last rank seeing the cut; `cut set`: to `set(cut/<t>)` returning "
        "(the coordinator's, or in `fixed` the one of the rank holding ticket c). c: the ticket "
        "of the rank that cut, else the policy's c in the batch the coordinator read.",
        "",
        "| " + " | ".join(h for _, h in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(str(r[k]) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.control_plane", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--iterations", type=int, help="default 60, 20 with --quick")
    parser.add_argument("--procs", type=int, help="rank processes (default ranks/32, 1-4)")
    parser.add_argument("--mode", choices=MODES, default="fixed")
    parser.add_argument(
        "--policy",
        default="",
        help="a policy spec (default static:C, C = 90%% "
        "of the ranks); an online one, e.g. ewma:online, revises c as reports come",
    )
    parser.add_argument("--quick", action="store_true", help="20 iterations")
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = parser.parse_args(argv)
    setup = default_setup(args.ranks, args.quick, args.mode, args.iterations)
    if args.procs or args.policy:
        setup = Setup(
            **{**asdict(setup), "procs": args.procs or setup.procs, "policy": args.policy}
        )
    result = measure(setup)
    print(json.dumps(result) if args.json else render([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
