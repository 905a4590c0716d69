"""Names, payloads and group construction shared by the server and the workers, so the protocol
lives in one place."""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from stages.errors import WorkerError

PARAMS_TAG = 1
GRAD_TAG = 2
PARAM_HEADER = 2  # iteration, cutoff
GRAD_HEADER = 3  # runtime_s, loss, worker
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
    """Which worker holds ticket ``ticket`` of iteration t, and its run-time
    (:func:`encode_arrival`)."""
    return f"a/{t}/{ticket}"


def encode_arrival(worker_id: int, runtime_s: float) -> str:
    return f"{worker_id},{runtime_s:.9f}"


def decode_arrival(blob: bytes) -> tuple[int, float]:
    """(process id, run-time in seconds) of an arrival key's value."""
    worker, runtime = blob.decode().split(",")
    return int(worker), float(runtime)


def cut_key(t: int) -> str:
    """Exists once iteration t has its c gradients: stragglers abandon it."""
    return f"cut/{t}"


def record_key(worker: int, batch: int) -> str:
    """A worker's appended per-iteration records for iterations in ``batch``."""
    return f"rec/{worker}/{batch}"


def members_key(generation: int) -> str:
    return f"gen/{generation}"


# -- payloads ---------------------------------------------------------------------------------
def pack_params(vector: torch.Tensor, t: int, cutoff: int) -> torch.Tensor:
    return torch.cat([torch.tensor([float(t), float(cutoff)]), vector])


def pack_grad(vector: torch.Tensor, runtime_s: float, loss: float, worker: int) -> torch.Tensor:
    return torch.cat([torch.tensor([runtime_s, loss, float(worker)]), vector])


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


@dataclass(frozen=True)
class Record:
    """One worker's account of one iteration (what becomes a trace row)."""

    iteration: int
    start_s: float
    runtime_s: float
    censored: bool
    delay_s: float

    def encode(self) -> str:
        return f"{self.iteration},{self.start_s:.6f},{self.runtime_s:.6f},{int(self.censored)},{self.delay_s:.6f};"

    @staticmethod
    def covers(blob: bytes, iteration: int) -> bool:
        """Whether an appended record blob holds ``iteration`` (without decoding it)."""
        return (b";" + blob).find(f";{iteration},".encode()) >= 0

    @staticmethod
    def decode_all(blob: bytes) -> list[Record]:
        out = []
        for item in filter(None, blob.decode().split(";")):
            t, start, rt, cen, delay = item.split(",")
            out.append(Record(int(t), float(start), float(rt), cen == "1", float(delay)))
        return out


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
    """The control store; the server hosts it on ``host`` (loopback unless the user names one)."""
    try:
        return dist.TCPStore(
            host,
            port,
            is_master=is_server,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except (RuntimeError, dist.DistStoreError) as exc:
        raise WorkerError(f"cannot reach the control store at {host}:{port}: {exc}") from None


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
