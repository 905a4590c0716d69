"""The wire: every c10d store key, every encoding and every process group that the library's
ranks, their coordinator, the parameter server and its workers share. A rank or a worker imports
this module, :mod:`bdsgd.stages.wire.report` and its loop, and nothing of the coordinating side
(the trace store, polars, pyarrow, rich).

Keys, by who reads them (``<t>`` an iteration, ``<w>`` a trace worker):

- every run: ``start_iteration``, ``t0`` (the clock origin), ``ready/<w>`` (a worker started
  and reached the store);
- synchronous (the library's loop): ``n/<t>`` (the ticket counter, with the announced c and
  ``CLOSED``), ``a/<t>/<ticket>`` (a :class:`WorkerReport`), ``cut/<t>`` (the cut), ``closed/<t>``;
- asynchronous (the parameter server): ``async/connect``, ``async/arrivals``,
  ``async/a/<ticket>``, ``async/end/<w>``, ``async/stop``; pair groups under ``async/pg/<w>/``.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
from bdsgd.stages.errors import WorkerError
from bdsgd.stages.wire.report import WorkerReport

# -- every variant ----------------------------------------------------------------------------
START_KEY = "start_iteration"  # the first iteration of this run (after --resume, not 0)
T0_KEY = "t0"  # the engine's clock origin (time.time()): trace rows' start_s count from it
PARAM_HEADER = 2  # a parameter message's head: (iteration, cutoff) or, async, (version, j)


def ready_key(worker: int) -> str:
    """Exists once trace worker ``worker`` has started and reached the store."""
    return f"ready/{worker}"


# -- synchronous: both variants ---------------------------------------------------------------
ONLINE = 0  # the cutoff a sync iteration announces when the server decides c as gradients arrive
CLOSED = 1 << 40  # added to an iteration's ticket counter to close it: later tickets exceed any c
LIMIT = 1 << 20  # a loop coordinator adds c * LIMIT to the counter to announce a fixed c


class Ticket(NamedTuple):
    """What one ``add`` on an iteration's ticket counter told the rank that took it."""

    number: int  # this rank's place in the arrival order (1, 2, ...)
    limit: int  # the fixed c announced in the counter before it (0: none, or not yet)
    closed: bool  # the counter was closed before it: cut


MAX_RANKS = LIMIT - 1  # tickets and an announced c each fit in the counter's low 20 bits


def decode_ticket(value: int) -> Ticket:
    """The counter's value after an ``add``: the tickets taken in its low 20 bits, an
    announced c (training loop, :func:`announce_limit`) above them, ``CLOSED`` once or twice
    (a rank and the coordinator may both close) above that."""
    return Ticket(value % LIMIT, (value % CLOSED) // LIMIT, value >= CLOSED)


def announce_limit(store, t: int, c: int) -> None:
    """Tell iteration t's ranks its fixed c through the ticket counter itself (no extra round
    trip for them): the rank whose ticket is c cuts the iteration (:func:`cut_at_limit`), one
    round trip after its ticket instead of after the coordinator's reads of c reports. A rank
    that took its ticket before the announcement sees limit 0 and leaves the cut to the
    coordinator."""
    move_limit(store, t, c)


def move_limit(store, t: int, by: int) -> Ticket:
    """Move iteration t's announced c by ``by`` (an online policy's revision: the c that stands
    until it is revised again); what the counter held after the move. A rank whose ticket was
    taken before compared it with the c announced then: if the counter is already past the new
    c, no rank holds it and the coordinator cuts at its next read."""
    return decode_ticket(store.add(ticket_key(t), by * LIMIT))


class StandingC:
    """The c standing in one iteration's ticket counter at a time, for a coordinator whose
    policy may revise it (the training loop's, ``benchmarks/control_plane.py``'s): every c that
    stood, so that a report read with such a ticket prompts a fresh look at the counter."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.begin()

    def begin(self) -> None:
        """A new iteration: nothing announced yet."""
        self.c, self.stood = 0, set()

    def move(self, store, t: int, target: int) -> bool:
        """Announce ``target`` in iteration t's counter, or move the standing c there (a c of
        every rank is no cut: 0); whether the counter was closed when moved (the holder of a c
        that stood before has cut)."""
        target = target if target < self.world else 0
        if target == self.c:
            return False
        moved = move_limit(store, t, target - self.c)
        self.c = target
        self.stood.add(target)
        return moved.closed

    def held_cut(self, store, t: int, first: int, last: int, timeout_s: float) -> bool:
        """Whether the holder of a c that stood cut iteration t, asked (one round trip) only
        when tickets ``first..last``, just read, hold such a c: the count read before them may
        predate that holder's close, which precedes its report."""
        if not any(first <= c <= last for c in self.stood):
            return False
        return tickets_admitted(store, t, timeout_s)[1]


def cut_at_limit(store, t: int, c: int) -> None:
    """What the holder of ticket c of an announced iteration does: set the cut (the ranks still
    computing stop at once), close the counter (tickets taken until then are admitted, as at
    the coordinator's close), and publish how many were admitted under :func:`closed_key`
    (unless the coordinator closed first, after its wait for arrivals timed out)."""
    store.set(cut_key(t), str(c))
    admitted, first = close_tickets(store, t)
    if first:
        store.set(closed_key(t), str(admitted))


def close_tickets(store, t: int) -> tuple[int, bool]:
    """Close iteration t's counter: (how many tickets were taken before it, whether this close
    was the first). After an earlier close the count also holds the tickets refused since:
    the admitted count is then the first closer's (:func:`closed_count`)."""
    value = store.add(ticket_key(t), CLOSED)
    return decode_ticket(value).number, value < 2 * CLOSED


def closed_count(store, t: int, timeout_s: float) -> int | None:
    """The tickets of iteration t admitted when a rank closed its counter (:func:`cut_at_limit`
    publishes it right after its close), waiting up to ``timeout_s``; None if none came."""
    if not wait_key(store, closed_key(t), timeout_s):
        return None
    return int(store.get(closed_key(t)))


def tickets_admitted(store, t: int, timeout_s: float) -> tuple[int | None, bool]:
    """Tickets of iteration t taken and admitted so far: the counter's, or, once a rank closed
    it, that rank's count (tickets taken after a close still move the counter; None if that
    rank gave none within ``timeout_s``); and whether a rank closed it (no more are admitted)."""
    counter = decode_ticket(store.add(ticket_key(t), 0))
    if counter.closed:
        return closed_count(store, t, timeout_s), True
    return counter.number, False


def tickets_taken(store, t: int) -> int:
    """Every ticket of iteration t taken so far, admitted or not (the counter's low bits)."""
    return decode_ticket(store.add(ticket_key(t), 0)).number


def closed_key(t: int) -> str:
    """How many tickets of iteration t were admitted, when a rank closed its counter (tickets
    taken after a close still move the counter, so the count is kept here)."""
    return f"closed/{t}"


def go_key(t: int) -> str:
    """Iteration t's announcement: ``"<generation>"`` (parameter server: its parameters are
    on their way), ``"<generation>,<c or ONLINE>,<live>"`` (collective: written after
    :func:`announce_key`, which a replica reads first), or ``"stop"``."""
    return f"go/{t}"


def ticket_key(t: int) -> str:
    """Atomic arrival counter of iteration t."""
    return f"n/{t}"


def arrival_key(t: int, ticket: int) -> str:
    """The :class:`WorkerReport` of the worker holding ticket ``ticket`` of iteration t."""
    return f"a/{t}/{ticket}"


def cut_key(t: int) -> str:
    """Exists once iteration t has its c gradients: stragglers abandon it. Its value is not
    read by bdsgd: the engines write the cut's wall time (``repr(time.time())``), a training
    loop's coordinator the tickets admitted, the rank that cuts at an announced c that c (the
    admitted count is under :func:`closed_key`)."""
    return f"cut/{t}"


# -- parameter server -------------------------------------------------------------------------


# -- collective -------------------------------------------------------------------------------


class Step(NamedTuple):
    """A published step, decoded (:func:`decode_step`)."""

    stats: tuple | None  # (n, sum |g_i|^2, |mean|^2, samples); None: nothing was applied
    evaluated: tuple[int, float] | None  # (iteration, held-out loss after it) summed by it
    reports: list[tuple[int, WorkerReport]]  # (ticket, report) the all-reduce carried
    lr: float | None = None  # the learning rate the replicas stepped with; None: no step


BATCH_HEAD, BATCH_POINTER = b"B", b"@"  # a batch's first key holds it; the others point there


# -- asynchronous -----------------------------------------------------------------------------
ASYNC_PARAMS_TAG = 11
ASYNC_GRAD_TAG = 12
STOP_VERSION = -1.0  # a parameter message with this version tells an asynchronous worker to stop
ASYNC_CONNECT = "async/connect"  # the live workers ("0,2,..."), once ready: the server builds pairs
ASYNC_ARRIVALS = "async/arrivals"  # counter: the global arrival ticket
ASYNC_STOP = "async/stop"  # exists once the run is over: computing workers abandon their work


def async_arrival_key(ticket: int) -> str:
    """The :class:`WorkerReport` of the computation holding arrival ticket ``ticket``
    (1-based)."""
    return f"async/a/{ticket}"


def async_end_key(worker: int) -> str:
    """A stopped worker's unfinished computation: its censored :class:`WorkerReport` (or
    empty when it had none under way)."""
    return f"async/end/{worker}"


# -- payloads ---------------------------------------------------------------------------------
def pack_params(vector: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """A parameter message: the :data:`PARAM_HEADER` (``a``, ``b``), then ``vector``."""
    return torch.cat([torch.tensor([float(a), float(b)]), vector])


def flat_views(flat: torch.Tensor, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Views into ``flat`` shaped like each parameter, in :func:`parameters_to_vector` order."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


def bind_flat(params: Iterable[torch.Tensor], data: torch.Tensor, grads: torch.Tensor) -> None:
    """Make each parameter a view into ``data`` and its gradient a view into ``grads``, so a
    payload is received into the model and a gradient sent from it without copies. The values
    move into ``data``; gradients start at zero (backward accumulates into the views in place,
    and ``zero_grad(set_to_none=False)`` keeps them)."""
    params = list(params)
    for p, d, g in zip(params, flat_views(data, params), flat_views(grads, params), strict=True):
        d.copy_(p.detach())
        p.data = d
        g.zero_()
        p.grad = g


# -- store helpers ----------------------------------------------------------------------------
def wait_key(store: dist.Store, key: str, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``key``; False on timeout. The wait ends as soon as the key
    appears, which is what makes an injected delay end early when a straggler is cut off."""
    if timeout_s <= 0:
        return store.check([key])
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        return True
    except dist.DistStoreError:
        return False


def wait_keys(store: dist.Store, keys: list[str], timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` until every one of ``keys`` exists (one round trip when they
    do); False on timeout."""
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return True
    except dist.DistStoreError:
        return False


def get_key(store: dist.Store, key: str) -> bytes | None:
    """``key``'s value once it exists, waiting up to the store's own timeout (one call: a
    TCPStore ``get`` waits for the key); None on timeout. A store that went away raises."""
    try:
        return store.get(key)
    except dist.DistStoreError:
        return None


def open_store(host: str, port: int, is_server: bool, timeout_s: float) -> dist.TCPStore:
    """The control store. The server hosts it on ``host`` alone (loopback unless the user names
    an address): torch's own master socket would listen on every interface, so the server binds
    and listens itself (:func:`listen_on`) and hands the socket to the store. Under torchrun with
    its agent's store, that store is torchrun's (see docs/security.md)."""
    try:
        fd = None
        if is_server:
            fd, port = listen_on(host, port)
        return dist.TCPStore(
            host,
            port,
            is_master=is_server,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=fd,
        )
    except (OSError, RuntimeError, dist.DistStoreError) as exc:
        raise WorkerError(f"cannot reach the control store at {host}:{port}: {exc}") from None


# -- process groups ---------------------------------------------------------------------------
def gloo_group(
    store: dist.Store, prefix: str, rank: int, size: int, host: str, timeout_s: float
) -> dist.ProcessGroupGloo:
    """The one way a gloo group is built: ``size`` members rendezvousing under ``prefix`` in the
    store (a new generation never meets an old one), this process's device on ``host``."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)


def listen_on(host: str, port: int) -> tuple[int, int]:
    """A TCP socket listening on ``host``'s address alone (port 0: any free port): its file
    descriptor, which the store then owns and closes, and its port."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return sock.detach(), port


def pair_group(
    store: dist.Store, worker: int, me: int, host: str, timeout_s: float
) -> dist.ProcessGroupGloo:
    """The asynchronous engine's group of the server (rank 0) and trace worker ``worker`` (rank
    1); ``me`` is 0 on the server and 1 on the worker. A worker that dies breaks only its pair."""
    return gloo_group(store, f"async/pg/{worker}/", me, 2, host, timeout_s)


def quiet_c10d_logs() -> None:
    """c10d logs a warning for every store wait that times out; our delays time out by design."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def shutdown(group, graceful: bool = False) -> None:
    """Close a process group's connections, so members still blocked in it fail at once
    (``graceful``: at the end of a run, nothing pending: shut down first, abort if that fails;
    NCCL's communicators are then released before the process exits, not torn down by it)."""
    for name in ("shutdown", "abort") if graceful else ("abort", "shutdown"):
        try:
            getattr(group, name)()
            return
        except (AttributeError, RuntimeError, dist.DistError):
            continue
