"""What the collective coordinator tells the replicas before they run: the generations (members,
and the iteration each resumes at), the announcements of iterations, a block at a time (``cgo/<t>``
as one integer, then ``go/<t>`` as text, both at the block's first iteration), and the records
(after which iterations the trace rows and, with a run directory, the lowest replica's state are
written). The keys and encodings are the wire's (:mod:`bdsgd.stages.engine.protocol`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch.distributed as dist
from bdsgd.stages.engine import protocol as P


class Announcer:
    """The generation and the announcements the coordinator has written; ``record_clock`` says
    whether a record is due by time (:meth:`Engine.record_clock`)."""

    def __init__(self, c10d: dist.Store, record_batch: int, record_clock: Callable[[], bool]):
        self.c10d, self.record_batch, self.record_clock = c10d, record_batch, record_clock
        self.generation = -1
        self.members: list[int] = []
        self.limit = 0  # the limit last announced
        self.block_starts: set[int] = set()  # iterations whose announcement keys were written
        self.cuttable: set[int] = set()  # iterations announced with c below the live count
        self.records: set[int] = set()  # iterations after which the rows and state are written
        self.checkpointed = c10d.get(P.STATES_KEY) == b"1"  # a run directory takes states

    def new_generation(self, live: np.ndarray, resume: int) -> bool:
        """A new generation of the ``live`` workers, resuming at ``resume``, unless they are the
        members already; whether one began."""
        members = (np.flatnonzero(live) + 1).tolist()
        if members == self.members:
            return False
        self.generation += 1
        self.members = members
        self.c10d.set(P.generation_key(self.generation), f"{P.encode_members(members)};{resume}")
        return True

    def write(self, first: int, last: int, live_arrivals: bool) -> None:
        """Iterations ``first..last`` of the current generation, with the last limit announced,
        and whether the coordinator reads arrivals live: as one integer for the replicas'
        one-round-trip read (set, not added: a regrouping announces again over an older one),
        then as text, which a replica that came early waits for (it then reads the integer)."""
        live = int(live_arrivals)
        code = P.encode_announcement(self.generation, self.limit, live, last - first)
        self.c10d.set(P.announce_key(first), str(code))
        self.c10d.set(P.go_key(first), f"{self.generation},{self.limit},{live}")
        self.block_starts.add(first)
        if self.limit < len(self.members):  # the replicas take tickets, and cut
            self.cuttable.update(range(first, last + 1))

    def decide_records(self, first: int, last: int) -> None:
        """Decide which of the iterations about to be announced are followed by a record, and
        tell the lowest replica, which publishes its state only there, before any of them is
        announced: a replica running a block ahead reads the decision after the iteration."""
        for k in range(first, last + 1):
            if (k + 1) % self.record_batch == 0 and self.record_clock():
                self.records.add(k)
                if self.checkpointed:
                    self.c10d.set(P.record_key(k + 1), "1")

    def take_record(self, t: int) -> bool:
        """Whether a record follows t, as decided when t was announced (asked once)."""
        if t in self.records:
            self.records.discard(t)
            return True
        return False

    def retire(self, t: int) -> tuple[bool, bool]:
        """Forget iteration t: whether its announcement keys were written (a block's first), and
        whether it was announced with a c that could cut (the replicas took tickets)."""
        started, cut = t in self.block_starts, t in self.cuttable
        self.block_starts.discard(t)
        self.cuttable.discard(t)
        return started, cut
