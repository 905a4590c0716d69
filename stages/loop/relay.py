"""The cut, relayed per node: one waiter on the job's store per node, not one check per rank and
micro-batch.

A rank of a cutoff loop looks for its iteration's cut (``cut/<t>``) between its micro-batches.
Asked of the job's c10d store, that is a round trip per rank and micro-batch on the store that
also carries every ticket and report: at 1,024 ranks and 4 micro-batches, 4,096 calls an
iteration. With the relay, the first rank of each node runs :class:`CutRelay`, a thread with its
own connection to the job's store that waits for each iteration's cut in turn and sets it in a
node-local store (a c10d TCPStore on loopback, hosted by that rank); the node's ranks look there,
and the job's store answers one waiter per node.

``LoopConfig.cut_relay``: None (the default) relays when the job spans more than one host and a
host runs more than one rank; True or False forces it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch.distributed as dist
from bdsgd.stages.errors import BdsgdError, first_line
from bdsgd.stages.wire import keys as P

LOCAL_HOST = "127.0.0.1"
WAIT_S = 30.0
"""Longest single wait of the relay on the job's store. c10d logs a warning (that torch's log
level, read at import, cannot silence later) for every wait that times out, so the waits are
long: an iteration shorter than this logs nothing. :meth:`CutRelay.close` wakes the wait."""
KEEP = 4
"""Iterations of cut keys the node-local store keeps (older ones are deleted)."""
JOIN_S = 10.0
NO_RELAY = "none"  # what a node's first rank publishes when it could not start the relay


def own_connection(c10d):
    """A new client of the same c10d store (``Store.clone``)."""
    try:
        return c10d.clone()
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        raise BdsgdError(
            f"bdsgd needs a process group whose store takes a second connection (torchrun, "
            f"env:// or tcp://): {first_line(exc)}"
        ) from None


def wants_relay(setting: bool | None, hosts: list[str]) -> bool:
    """Whether a job whose ranks run on ``hosts`` (one name per rank) relays its cut."""
    if setting is not None:
        return setting
    return len(set(hosts)) > 1 and len(hosts) > len(set(hosts))


class CutRelay:
    """The relay thread: waits on the job's store (a connection of its own, cloned from its
    rank's ``job``) for ``cut/<t>`` of each iteration from ``current()`` (its rank's iteration)
    on, and sets it in the node-local store at ``port``."""

    def __init__(self, job: dist.Store, port: int, current: Callable[[], int], timeout_s: float,
                 wait_s: float = WAIT_S) -> None:  # fmt: skip
        self.job, self.current, self.wait_s = job, current, min(wait_s, timeout_s)
        self.listen = own_connection(job)  # blocked in waits: nothing else may use it
        self.local = P.open_store(LOCAL_HOST, port, False, timeout_s)  # its own connection
        self.relayed = 0
        self.pending = current()  # the iteration whose cut it waits for
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bdsgd-cut-relay", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t = self.current()
        try:
            while not self._stop.is_set():
                t = self.pending = max(t, self.current())
                if P.wait_key(self.listen, P.cut_key(t), self.wait_s):
                    if self._stop.is_set():  # woken by close: no iteration t runs
                        return
                    if t >= KEEP:  # (before the new key: whoever sees it sees this done)
                        self.local.delete_key(P.cut_key(t - KEEP))
                    self.relayed += 1
                    self.local.set(P.cut_key(t), b"1")
                    t += 1
        except RuntimeError:  # (torch's DistError is one)
            return  # a store gone: the node's ranks then run their micro-batches to the end

    def close(self) -> None:
        """Stop the relay after its rank's last iteration: the cut key of the iteration it waits
        for (after the last: no coordinator will run it) ends the wait."""
        self._stop.set()
        with contextlib.suppress(RuntimeError):  # the job's store already gone: so is the wait
            self.job.set(P.cut_key(self.pending), b"closed")  # (the rank's connection)
        self.thread.join(JOIN_S)


class NodeCut:
    """Where a rank looks for the cut: the node-local store when the job relays (the node's
    first rank hosts it and runs the :class:`CutRelay`), else the job's store. A relay that
    cannot start (no loopback store) leaves the node's ranks on the job's store: the relay
    only saves round trips, it decides nothing."""

    def __init__(self, job: dist.Store, hosts: list[str], rank: int, relay: bool,
                 current: Callable[[], int], timeout_s: float) -> None:  # fmt: skip
        self.view, self.server, self.relay = job, None, None
        if not relay:
            return
        host = hosts[rank]
        first = hosts.index(host)
        key = f"relay/{first}"
        if rank == first:
            try:
                self.server = P.open_store(LOCAL_HOST, 0, True, timeout_s)
                self.relay = CutRelay(job, self.server.port, current, timeout_s)
            except BdsgdError:
                self.server = self.relay = None
            job.set(key, str(self.server.port) if self.server is not None else NO_RELAY)
            self.view = self.server if self.server is not None else job
            return
        port = P.get_key(job, key)
        if port is None:
            raise BdsgdError(f"the cut relay of rank {first} on {host} did not answer")
        if port.decode() != NO_RELAY:
            try:
                self.view = P.open_store(LOCAL_HOST, int(port), False, timeout_s)
            except BdsgdError:
                self.view = job

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
