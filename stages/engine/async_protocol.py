"""Store keys, payloads and process groups of the engine's asynchronous mode (``k-async``,
``async``, ``adasync``), kept apart from the synchronous protocol (:mod:`bdsgd.stages.engine.protocol`).

Every worker has its own two-member gloo group with the server (a "pair"), so a worker that dies
breaks only its own pair: nobody else has to rebuild a group while the others keep computing.

Arrival order, across machines too, comes from one atomic counter in the store: a worker that
has a gradient takes a ticket (``store.add``), writes which worker holds it, then sends the
gradient over its pair; the server reads tickets in order and receives from their holders.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

PARAMS_TAG = 11
GRAD_TAG = 12
STOP_VERSION = -1.0  # a parameter message with this version tells the worker to stop
PARAM_HEADER = 2  # version, computation index j
MODE_KEY = "engine/mode"  # "sync" or "k-async": what a torchrun worker rank should run
READY = "async/ready"  # counter: workers connected to the store
CONNECT = "async/connect"  # the live workers ("0,2,..."), once ready: the server builds pairs
ARRIVALS = "async/arrivals"  # counter: the global arrival ticket
STOP = "async/stop"  # exists once the run is over: computing workers abandon their computation


def arrival_key(ticket: int) -> str:
    """The :class:`WorkerReport` of the computation holding arrival ticket ``ticket``
    (1-based)."""
    return f"async/a/{ticket}"


def end_key(worker: int) -> str:
    """A stopped worker's unfinished computation: its censored :class:`WorkerReport` (or
    empty when it had none under way)."""
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
