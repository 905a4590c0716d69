"""Store keys, payloads and process groups of the engine's asynchronous mode (``k-async``,
``async``, ``adasync``), kept apart from the synchronous protocol (:mod:`stages.engine.protocol`).

Every worker has its own two-member gloo group with the server (a "pair"), so a worker that dies
breaks only its own pair: nobody else has to rebuild a group while the others keep computing.

Arrival order, across machines too, comes from one atomic counter in the store: a worker that
has a gradient takes a ticket (``store.add``), writes which worker holds it, then sends the
gradient over its pair; the server reads tickets in order and receives from their holders.
"""

from __future__ import annotations

import datetime
from typing import NamedTuple

import torch
import torch.distributed as dist

PARAMS_TAG = 11
GRAD_TAG = 12
STOP_VERSION = -1.0  # a parameter message with this version tells the worker to stop
PARAM_HEADER = 2  # version, computation index j
GRAD_HEADER = 7  # runtime_s, loss, worker, version, j, start_s, delay_s
MODE_KEY = "engine/mode"  # "sync" or "k-async": what a torchrun worker rank should run
READY = "async/ready"  # counter: workers connected to the store
CONNECT = "async/connect"  # the live workers ("0,2,..."), once ready: the server builds pairs
ARRIVALS = "async/arrivals"  # counter: the global arrival ticket
STOP = "async/stop"  # exists once the run is over: computing workers abandon their computation


def arrival_key(ticket: int) -> str:
    """Which worker (process id) holds arrival ticket ``ticket`` (1-based)."""
    return f"async/a/{ticket}"


def end_key(worker: int) -> str:
    """A stopped worker's unfinished computation: ``"j,start_s,elapsed_s,delay_s"`` (or ``""``)."""
    return f"async/end/{worker}"


def pair_group(
    store: dist.Store, worker: int, me: int, host: str, timeout_s: float
) -> dist.ProcessGroupGloo:
    """The gloo group of the server (rank 0) and trace worker ``worker`` (rank 1); ``me`` is 0 on
    the server and 1 on the worker."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore(f"async/pg/{worker}/", store), me, 2, opts)


def pack_params(vector: torch.Tensor, version: float, j: int) -> torch.Tensor:
    return torch.cat([torch.tensor([float(version), float(j)]), vector])


def pack_grad(vector: torch.Tensor, header: GradHeader) -> torch.Tensor:
    return torch.cat([torch.tensor(header.values()), vector])


class GradHeader(NamedTuple):
    """What travels in front of a gradient: the facts of the computation (its trace row)."""

    runtime_s: float
    loss: float
    worker: int  # trace worker 0..N-1
    version: int  # updates applied when the worker read its parameters
    j: int  # the worker's computation index (the trace row's iteration)
    start_s: float  # when the computation began, seconds since run start
    delay_s: float  # injected delay it waited out

    def values(self) -> list[float]:
        return [float(v) for v in self]

    @staticmethod
    def unpack(buf: torch.Tensor) -> GradHeader:
        rt, loss, w, version, j, start, delay = buf[:GRAD_HEADER].tolist()
        return GradHeader(rt, loss, int(w), int(version), int(j), start, delay)


def encode_end(j: int, start_s: float, elapsed_s: float, delay_s: float) -> str:
    return f"{j},{start_s:.6f},{elapsed_s:.6f},{delay_s:.6f}"


def decode_end(blob: bytes) -> tuple[int, float, float, float] | None:
    if not blob:
        return None
    j, start, elapsed, delay = blob.decode().split(",")
    return int(j), float(start), float(elapsed), float(delay)
