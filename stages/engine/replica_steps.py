"""What a collective replica publishes for the coordinator, and the group it sums in.

Each step (its gradient statistics, the learning rate applied, the held-out loss the all-reduce
summed, the reports it carried) is published by the lowest replica: one at a time when the
coordinator reads the arrivals live, in batches of up to ``STEP_BATCH`` for a fixed c, whose
coordinator reads them a batch at a time (:func:`bdsgd.stages.engine.protocol.batch_values`).
Every member keeps a fixed c's steps until they are published: if the lowest dies before it
publishes them, a survivor does.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist
from bdsgd.stages.engine import protocol as P


class StepPublisher:
    """A replica's steps on their way to the coordinator. ``unpublished``: a fixed c's steps not
    yet published; ``last_batch``: the last batch the lowest published, kept until an all-reduce
    after it shows that the lowest lived to publish it (each step as the arguments of
    :func:`bdsgd.stages.engine.protocol.encode_step`, encoded only when published: the members
    other than the lowest publish theirs only after a failure)."""

    def __init__(self, c10d: dist.Store) -> None:
        self.c10d = c10d
        self.unpublished: list[tuple[int, tuple]] = []
        self.last_batch: list[tuple[int, tuple]] = []

    def add(self, t: int, parts: tuple, lowest: bool, live: bool, block_end: bool) -> None:
        """Step t: published at once by the lowest when the coordinator reads arrivals ``live``
        (and steps one by one); else kept, and published with its batch when the batch is full
        or the block announced ahead ends (``block_end``: the next block waits for it)."""
        if live:
            if lowest:
                self.c10d.set(P.step_key(t), P.encode_step(*parts))
            return
        self.unpublished.append((t, parts))
        if len(self.unpublished) >= P.STEP_BATCH or block_end:
            self.publish(lowest)

    def survived(self) -> None:
        """An all-reduce ended on every member, the lowest too: it lived to publish its last
        batch."""
        self.last_batch = []

    def publish(self, lowest: bool, every: bool = False) -> None:
        """The steps of a fixed c not yet published, in one round trip, each under its own key,
        by the lowest replica: before it waits for anything the coordinator does after reading
        them (its next block, a new generation) and at the end. With ``every``, by any member,
        with the last batch too (after a failed all-reduce, and before it joins a new
        generation: the lowest may have died before it published them; the same bytes twice
        change nothing)."""
        if lowest:
            if self.unpublished:
                self.c10d.multi_set(*batch_keys(self.unpublished))
        elif every:
            for batch in (self.last_batch, self.unpublished):
                if batch:
                    self.c10d.multi_set(*batch_keys(batch))
        self.last_batch, self.unpublished = self.unpublished, []


def batch_keys(steps: list[tuple[int, tuple]]) -> tuple[list[str], list[bytes]]:
    encoded = [(t, P.encode_step(*parts)) for t, parts in steps]
    return [P.step_key(t) for t, _ in steps], P.batch_values(encoded)


def replica_group(c10d, generation: int, rank: int, size: int, nccl: bool, bind_host: str,
                  timeout_s: float):  # fmt: skip
    """The group a generation's replicas sum in: gloo's, or NCCL's where every replica can.
    Under NCCL, ``wait()`` blocks and raises at the timeout (which the replica recovers from)
    instead of the watchdog tearing the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING's
    default): a dead member then costs the survivors a regrouping, not their lives. Read when
    the group is made."""
    prefix = P.collective_prefix(generation)
    if not nccl:
        return P.gloo_group(c10d, prefix, rank, size, bind_host, timeout_s)
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, c10d), rank, size, opts)


def eval_rows(n: int, rank: int, size: int) -> tuple[slice, float]:
    """A member's slice of a held-out batch of n rows (members split it in order) and the
    slice's share of the batch."""
    lo, hi = rank * n // size, (rank + 1) * n // size
    return slice(lo, hi), (hi - lo) / n
