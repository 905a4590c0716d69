"""Names, payloads and group construction shared by the server and the workers, so the protocol
lives in one place."""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
from bdsgd.stages.errors import WorkerError

PARAMS_TAG = 1
GRAD_TAG = 2
PARAM_HEADER = 2  # iteration, cutoff
ONLINE = 0  # the cutoff a sync iteration announces when the server decides c as gradients arrive
CLOSED = 1 << 20  # added to an iteration's ticket counter to close it: later tickets exceed any c
STOP = "stop"
READY = "ready"  # counter: workers that have started and reached the store


# -- store keys -------------------------------------------------------------------------------
def go_key(t: int) -> str:
    """Set by the server when iteration t's parameters are on their way: ``"<generation>"`` or
    ``"stop"``."""
    return f"go/{t}"


def ticket_key(t: int) -> str:
    """Atomic arrival counter of iteration t."""
    return f"n/{t}"


def arrival_key(t: int, ticket: int) -> str:
    """The :class:`WorkerReport` of the worker holding ticket ``ticket`` of iteration t."""
    return f"a/{t}/{ticket}"


def cut_key(t: int) -> str:
    """Exists once iteration t has its c gradients: stragglers abandon it."""
    return f"cut/{t}"


def members_key(generation: int) -> str:
    return f"gen/{generation}"


# -- payloads ---------------------------------------------------------------------------------
def pack_params(vector: torch.Tensor, t: int, cutoff: int) -> torch.Tensor:
    return torch.cat([torch.tensor([float(t), float(cutoff)]), vector])


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
def build_group(
    store: dist.Store, generation: int, members: list[int], me: int, host: str, timeout_s: float
) -> dist.ProcessGroupGloo:
    """A gloo group among ``members`` (process ids; the server, 0, is always group rank 0),
    rendezvousing under its own store prefix so that a new generation never meets an old one."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    prefixed = dist.PrefixStore(f"pg/{generation}/", store)
    return dist.ProcessGroupGloo(prefixed, members.index(me), len(members), opts)


def encode_members(members: list[int]) -> str:
    return ",".join(map(str, members))


def decode_members(blob: bytes) -> list[int]:
    return [int(x) for x in blob.decode().split(",")]


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
