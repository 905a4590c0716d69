"""The wire: every c10d store key, every encoding and every process group that the engine
process and its workers share, for all three variants (parameter server, collective, asynchronous).
A worker process imports this module, :mod:`bdsgd.stages.wire.report` and its loop, and
nothing of the engine's side (the trace store, polars, pyarrow, rich).

Keys, by who reads them (``<t>`` an iteration, ``<g>`` a generation, ``<w>`` a trace worker):

- every variant: ``engine/mode`` (the variant, for torchrun worker ranks), ``start_iteration``,
  ``t0`` (the engine's clock origin), ``ready/<w>`` (a worker started and reached the store);
- synchronous (both): ``go/<t>`` (the announcement: ``"<g>"`` on the parameter server,
  ``"<g>,<c or ONLINE>,<live>"`` on the collective engine, or ``"stop"``), ``n/<t>`` (ticket
  counter), ``a/<t>/<ticket>`` (a :class:`WorkerReport`), ``cut/<t>`` (the cut's wall time);
- parameter server: ``gen/<g>`` (members), gloo groups under ``pg/<g>/``;
- collective: ``cgen/<g>``, ``cjoined/<g>``, ``cfail/<g>``, ``cgo/<t>``, ``cstep/<t>``,
  ``crecord/<steps>``, ``creplica/<steps>``, ``ceval/<t>``, ``clag/<w>``, ``cdigest/<w>``,
  ``cdevice/<w>``, the settings ``callreduce``, ``cstates`` and the vote ``cnonccl``; groups
  under ``cpg/<g>/``;
- asynchronous: ``async/connect``, ``async/arrivals``, ``async/a/<ticket>``, ``async/end/<w>``,
  ``async/stop``; pair groups under ``async/pg/<w>/``.
"""

from __future__ import annotations

import datetime
import io
import os
import socket
import struct
import time
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from bdsgd.stages.errors import WorkerError
from bdsgd.stages.wire.report import WorkerReport

# -- every variant ----------------------------------------------------------------------------
VARIANT_KEY = "engine/mode"  # "ps", "collective" or "async": what a torchrun worker rank runs
START_KEY = "start_iteration"  # the first iteration of this run (after --resume, not 0)
T0_KEY = "t0"  # the engine's clock origin (time.time()): trace rows' start_s count from it
PARAM_HEADER = 2  # a parameter message's head: (iteration, cutoff) or, async, (version, j)


def ready_key(worker: int) -> str:
    """Exists once trace worker ``worker`` has started and reached the store."""
    return f"ready/{worker}"


# -- synchronous: both variants ---------------------------------------------------------------
PARAMS_TAG = 1
GRAD_TAG = 2
ONLINE = 0  # the cutoff a sync iteration announces when the server decides c as gradients arrive
CLOSED = 1 << 40  # added to an iteration's ticket counter to close it: later tickets exceed any c
LIMIT = 1 << 20  # a loop coordinator adds c * LIMIT to the counter to announce a fixed c
STOP = "stop"


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
def members_key(generation: int) -> str:
    """The parameter server's generation: its members (process ids, the server 0 first)."""
    return f"gen/{generation}"


def encode_members(members: list[int]) -> str:
    return ",".join(map(str, members))


def decode_members(blob: bytes) -> list[int]:
    return [int(x) for x in blob.decode().split(",")]


# -- collective -------------------------------------------------------------------------------
ALLREDUCE_KEY = "callreduce"  # how the replicas sum: "ring" or "star"
STATES_KEY = "cstates"  # "1": the lowest replica publishes its state for each checkpoint
NCCL_VETO_KEY = "cnonccl"  # counter: replicas that cannot use NCCL (CPU, or a shared GPU)
STEP_BATCH = 32  # steps of a fixed c the lowest replica publishes at once, at most
STAR_TAG = 11  # the star sum's messages


def generation_key(generation: int) -> str:
    """``"<members>;<iteration to resume at>"`` of a generation (members are process ids)."""
    return f"cgen/{generation}"


def joined_key(generation: int) -> str:
    """Counts the members that joined ``generation`` (each after publishing the steps it holds
    of the generation before)."""
    return f"cjoined/{generation}"


def fail_key(generation: int) -> str:
    """Appended ``"<worker>,"`` by each member whose all-reduce failed in ``generation``."""
    return f"cfail/{generation}"


def eval_key(t: int | str) -> str:
    """The held-out loss after iteration t (or ``final``), from the lowest replica."""
    return f"ceval/{t}"


def replica_key(steps: int | str) -> str:
    """The lowest replica's state (:func:`encode_replica_state`) after ``steps`` iterations,
    at each checkpoint and at the end (``final``); ``init`` holds a resumed run's state."""
    return f"creplica/{steps}"


def record_key(steps: int) -> str:
    """Exists when the lowest replica is to publish its state after ``steps`` iterations: the
    coordinator checkpoints there."""
    return f"crecord/{steps}"


def step_key(t: int) -> str:
    """Iteration t's all-reduce as the lowest replica saw it (:func:`encode_step`, in a batch:
    :func:`batch_values`): the gradient statistics behind the coordinator's noise scale, and
    the reports it carried."""
    return f"cstep/{t}"


def announce_key(t: int) -> str:
    """Iteration t's announcement as one integer (:func:`encode_announcement`), read by a
    replica in one round trip (``add(key, 0)``: 0 until announced)."""
    return f"cgo/{t}"


def lag_key(worker: int) -> str:
    """A replica's join lags (cut to all-reduce entry), milliseconds, comma-separated."""
    return f"clag/{worker}"


def digest_key(worker: int) -> str:
    """A replica's parameter digest at the end of the run."""
    return f"cdigest/{worker}"


def device_key(worker: int) -> str:
    """The device type a replica computes on (``cpu`` or ``cuda``), set before it is ready:
    each machine resolves ``--device`` for its own workers, so the coordinator's host (under
    torchrun, perhaps one without a GPU) does not guess it."""
    return f"cdevice/{worker}"


def encode_announcement(generation: int, limit: int, live: int, span: int = 0) -> int:
    """One integer >= 1 for (generation, limit, live, span): the same announcement holds for the
    ``span`` iterations after this one too (0 <= span < 256)."""
    return 1 + limit + (live << 23) + (span << 24) + (generation << 32)


def decode_announcement(code: int) -> tuple[int, int, int, int]:
    """(generation, limit, live, span) of an :func:`encode_announcement` code."""
    code -= 1
    return code >> 32, code & ((1 << 23) - 1), (code >> 23) & 1, (code >> 24) & 255


def encode_step(
    stats: tuple,
    slots: bytes,
    evaluated: tuple[int, float] | None = None,
    lr: float | None = None,
) -> bytes:
    """``"n,sum |g_i|^2,|mean|^2,samples"`` (empty when nothing was applied), then
    ``";<iteration>,<held-out loss>"`` when the all-reduce summed one (empty after the ``;``
    otherwise), then ``";<lr>"``, the learning rate the step applied (empty when none), a
    newline, then the reduced report slots (float32 bytes, :meth:`WorkerReport.from_slots`)."""
    head = ";".join((",".join(map(repr, stats)), ",".join(map(repr, evaluated or ())),
                     "" if lr is None else repr(lr)))  # fmt: skip
    return head.encode() + b"\n" + slots


class Step(NamedTuple):
    """A published step, decoded (:func:`decode_step`)."""

    stats: tuple | None  # (n, sum |g_i|^2, |mean|^2, samples); None: nothing was applied
    evaluated: tuple[int, float] | None  # (iteration, held-out loss after it) summed by it
    reports: list[tuple[int, WorkerReport]]  # (ticket, report) the all-reduce carried
    lr: float | None = None  # the learning rate the replicas stepped with; None: no step


def decode_step(blob: bytes, slots: bool = True) -> Step:
    """A step published by :func:`encode_step` (no reports unless ``slots``)."""
    head, _, rest = blob.partition(b"\n")
    applied, evaluated, lr = head.decode().split(";")
    stats = None
    if applied:
        n, sq, mean_sq, samples = applied.split(",")
        stats = (int(n), float(sq), float(mean_sq), int(samples))
    loss = None
    if evaluated:
        t, value = evaluated.split(",")
        loss = (int(t), float(value))
    reports = WorkerReport.from_slots(np.frombuffer(rest, dtype="f4")) if slots else []
    return Step(stats, loss, reports, float(lr) if lr else None)


BATCH_ENTRY = struct.Struct("<qI")  # iteration, length of its step
BATCH_HEAD, BATCH_POINTER = b"B", b"@"  # a batch's first key holds it; the others point there


def batch_values(steps: list[tuple[int, bytes]]) -> list[bytes]:
    """The values of consecutive (iteration, :func:`encode_step` bytes), one per
    :func:`step_key` of the batch: the first key holds every step of the batch, each later one
    points to it (``@<first iteration>``), so whichever key the coordinator waits for (the
    first it has not read: after a regrouping, one inside a batch) leads it to the whole batch
    in one or two reads, and a batch of k steps moves k steps, not k(k+1)/2."""
    blob = BATCH_HEAD + b"".join(BATCH_ENTRY.pack(t, len(step)) + step for t, step in steps)
    return [blob] + [BATCH_POINTER + str(steps[0][0]).encode()] * (len(steps) - 1)


def batch_pointer(value: bytes) -> int | None:
    """The batch's first iteration, where ``value`` points to it; None where it is the batch."""
    return int(value[1:]) if value[:1] == BATCH_POINTER else None


def decode_batch(blob: bytes) -> dict[int, bytes]:
    """iteration -> its step, of a batch's first value (:func:`batch_values`)."""
    steps, at = {}, len(BATCH_HEAD)
    while at < len(blob):
        t, size = BATCH_ENTRY.unpack_from(blob, at)
        at += BATCH_ENTRY.size
        steps[t], at = blob[at : at + size], at + size
    return steps


def encode_replica_state(state: dict) -> bytes:
    """A replica's state (tensors and plain values) as ``torch.save`` bytes."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def decode_replica_state(blob: bytes) -> dict:
    """A replica state from its bytes: tensors and plain values only (never runs code)."""
    return torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")


def vote_backend(store: dist.Store, mine: str) -> None:
    """A replica's say in the backend, before it reports ready: NCCL only if every replica can
    use it (each machine decides for its own workers, and machines may differ under torchrun:
    mixed backends would hang the group's rendezvous)."""
    store.add(NCCL_VETO_KEY, int(mine != "nccl"))


def agreed_backend(store: dist.Store, mine: str) -> str:
    """The backend every replica builds its groups with, once all have voted (the coordinator
    announces the first generation only after every replica reported ready)."""
    return "nccl" if mine == "nccl" and store.add(NCCL_VETO_KEY, 0) == 0 else "gloo"


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


def pack_params_of(params: Iterable[torch.Tensor], t: int, cutoff: int) -> torch.Tensor:
    """:func:`pack_params` of a model's parameters in one copy (no flat vector in between)."""
    header = torch.tensor([float(t), float(cutoff)])
    return torch.cat([header, *(p.detach().reshape(-1) for p in params)])


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


def wait_key_until(store: dist.Store, key: str, deadline: float, slice_s: float = 0.5) -> bool:
    """Wait for ``key`` until the monotonic ``deadline``, in slices (so a caller's checks can run
    between them via repeated calls). False when the deadline passed."""
    while (left := deadline - time.monotonic()) > 0:
        if wait_key(store, key, min(slice_s, left)):
            return True
    return False


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


def build_group(
    store: dist.Store, generation: int, members: list[int], me: int, host: str, timeout_s: float
) -> dist.ProcessGroupGloo:
    """The parameter server's group among ``members`` (process ids; the server, 0, is always
    group rank 0)."""
    return gloo_group(store, f"pg/{generation}/", members.index(me), len(members), host, timeout_s)


def collective_prefix(generation: int) -> str:
    """Where a collective generation's group (gloo or NCCL) rendezvouses."""
    return f"cpg/{generation}/"


def pair_group(
    store: dist.Store, worker: int, me: int, host: str, timeout_s: float
) -> dist.ProcessGroupGloo:
    """The asynchronous engine's group of the server (rank 0) and trace worker ``worker`` (rank
    1); ``me`` is 0 on the server and 1 on the worker. A worker that dies breaks only its pair."""
    return gloo_group(store, f"async/pg/{worker}/", me, 2, host, timeout_s)


def star_sum(group, rank: int, size: int, buf: torch.Tensor, inbox: list[torch.Tensor]):
    """Sum ``buf`` over a gloo group by star: rank 0 receives every other rank's buffer (into
    ``inbox``, one per other rank), adds them to its own in rank order and sends the sum back,
    so every rank ends with the same bytes. Starts rank 0's receives and returns what
    completes the sum."""
    if size == 1:
        return lambda: None
    if rank != 0:

        def leaf() -> None:
            group.send([buf], 0, STAR_TAG).wait()
            group.recv([buf], 0, STAR_TAG).wait()

        return leaf
    received = [group.recv([b], r, STAR_TAG) for r, b in enumerate(inbox, 1)]

    def root() -> None:
        for work in received:
            work.wait()
        for b in inbox:
            buf.add_(b)
        for work in [group.send([buf], r, STAR_TAG) for r in range(1, size)]:
            work.wait()

    return root


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
