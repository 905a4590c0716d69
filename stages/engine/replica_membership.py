"""A collective replica's generation: the members the coordinator named, the group they sum in
(rebuilt by each generation), the state every member takes as it joins (the most advanced
member's), the sum itself, and the way out of a failed one (report it, join the next generation).
Worker side: imports nothing of the coordinator's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.replica_steps import replica_group
from bdsgd.stages.engine.worker import check_member

if TYPE_CHECKING:
    from bdsgd.stages.engine.replica import Replica


class Membership:
    """The generation ``replica`` is a member of (-1: none yet), and its group."""

    def __init__(self, replica: Replica, backend: str, star: bool):
        self.replica, self.c10d, self.spec = replica, replica.c10d, replica.spec
        self.device, self.backend, self.star = replica.device, backend, star
        self.generation, self.group, self.members = -1, None, []
        self.inbox: list[torch.Tensor] = []  # the star's root: one contribution per member

    @property
    def lowest(self) -> bool:
        return bool(self.members) and self.members[0] == self.spec.worker_id

    def join(self, generation: int) -> int:
        """Build the group of ``generation`` (every generation after the first also takes the
        state of the member that applied the most steps); returns the iteration it resumes at.
        A replica the generation leaves out stops."""
        replica = self.replica
        replica.steps_out.publish(self.lowest, every=True)  # (the last generation's: the lowest
        # may have died before it published them)
        blob = self.c10d.get(P.generation_key(generation)).decode()
        members, resume = blob.split(";")
        self.members = P.decode_members(members.encode())
        check_member(self.spec, self.members)
        if self.group is not None:
            P.shutdown(self.group)
        self.group = self.build_group(generation)
        if self.star and self.lowest:
            self.inbox = [torch.empty_like(replica.comm) for _ in self.members[1:]]
        if self.generation >= 0:
            replica.steps = self.sync_state(replica.flat, replica.momentum, replica.steps)
        self.generation = generation
        self.c10d.add(P.joined_key(generation), 1)  # (after its steps: the coordinator knows
        return int(resume)  # that those it has not got by then never ran)

    def build_group(self, generation: int):
        """The generation's group. The replicas give up on a collective (half ``--timeout``)
        before the coordinator gives up on a ticket, so their failure reports tell it which
        member hangs."""
        nccl = P.agreed_backend(self.c10d, self.backend) == "nccl"
        rank, size = self.members.index(self.spec.worker_id), len(self.members)
        return replica_group(self.c10d, generation, rank, size, nccl, self.spec.bind_host,
                             self.spec.cfg.timeout_s / 2)  # fmt: skip

    def sync_state(self, flat: torch.Tensor, momentum: torch.Tensor, steps: int) -> int:
        """Everyone takes the parameters, momentum and step count of the member that applied
        the most steps (the lowest such): a member that died inside an all-reduce may have
        left its result with some survivors and not others, and those that applied it publish
        its step, so that update is logged and must be kept. Returns the step count taken."""
        counts = torch.zeros(len(self.members), device=self.device)
        counts[self.members.index(self.spec.worker_id)] = float(steps)
        self.group.allreduce([counts]).wait()
        source = source_rank(counts.tolist())
        taken = torch.tensor([float(steps)], device=self.device)
        for buf in (flat, momentum, taken):
            self.group.broadcast(buf, source).wait()
        return int(taken.item())

    def all_reduce(self, comm: torch.Tensor) -> bool:
        """The one collective of an iteration (gloo's ring all-reduce, NCCL's, or the star:
        :func:`bdsgd.stages.engine.collective.allreduce_algorithm`); False if it failed (a member
        died or hangs)."""
        try:
            (self.star_sum(comm) if self.star else self.ring_sum(comm))()
            return True
        except (RuntimeError, dist.DistError):
            return False

    def ring_sum(self, comm: torch.Tensor):
        """Start gloo's or NCCL's all-reduce; returns what waits for it."""
        return self.group.allreduce([comm]).wait

    def star_sum(self, comm: torch.Tensor):
        """The star (:func:`bdsgd.stages.engine.protocol.star_sum`), the lowest member at its root."""
        rank = self.members.index(self.spec.worker_id)
        return P.star_sum(self.group, rank, len(self.members), comm, self.inbox)

    def recover(self) -> int:
        """Report the failed all-reduce (after the steps applied before it, which every member
        publishes: the lowest may be the one that died) and wait for the coordinator's next
        generation; returns it (to join)."""
        self.replica.steps_out.publish(self.lowest, every=True)
        self.c10d.append(P.fail_key(self.generation), f"{self.replica.w},")
        P.shutdown(self.group)
        self.group = None
        key = P.generation_key(self.generation + 1)
        if not P.wait_key(self.c10d, key, 2 * self.spec.cfg.timeout_s):
            raise TimeoutError(f"worker {self.replica.w}: no new group after a failed all-reduce")
        return self.generation + 1

    def leave(self) -> None:
        """At the end (the run's last all-reduce has ended on every member)."""
        if self.group is not None:
            P.shutdown(self.group, graceful=True)
            self.group = None


def source_rank(steps: list[float]) -> int:
    """The rank whose state a new generation takes: the lowest of those that applied the most
    steps."""
    return steps.index(max(steps))
