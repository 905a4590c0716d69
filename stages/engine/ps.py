"""The parameter-server variant of the synchronous engine: the server holds the model, sends the
parameters to every live worker each iteration, receives the admitted gradients (a receive from
the ticket holder, posted per admitted ticket, so gradients land while the policy decides) and
steps."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.base import ServerModel
from bdsgd.stages.engine.config import scaled_lr
from bdsgd.stages.engine.sync import SyncEngine
from bdsgd.stages.engine.worker_report import WorkerReport
from torch.nn.utils import parameters_to_vector


class ParameterServer(SyncEngine):
    kind = "ps"

    def __init__(self, cfg, c10d, workload, policy, writer, alive):
        super().__init__(cfg, c10d, policy, writer, alive)
        self.params = ServerModel(workload, cfg)
        self.generation, self.group, self.members = -1, None, [0]
        self.pending_sends: list = []
        size = parameters_to_vector(self.params.model.parameters()).numel()
        self.grad_bufs: list[torch.Tensor] = []  # one receive buffer per admitted gradient
        self.recvs: list[tuple[dist.Work | None, torch.Tensor, int]] = []
        self.flat_grad = torch.zeros(size)  # the admitted gradients' sum

    def announce(self, t: int, limit: int) -> None:
        """New generation if the live set changed, then parameters to every live worker."""
        members = [0, *(np.flatnonzero(self.live) + 1).tolist()]
        if members != self.members:
            self.generation += 1
            self.c10d.set(P.members_key(self.generation), P.encode_members(members))
        self.c10d.set(P.go_key(t), str(self.generation))
        if members != self.members:
            self.group = P.build_group(
                self.c10d, self.generation, members, 0, self.cfg.host, self.cfg.timeout_s
            )
            self.members = members
        payload = P.pack_params_of(self.params.model.parameters(), t, limit)
        self.pending_sends = [
            self.group.send([payload], r, P.PARAMS_TAG) for r in range(1, len(members))
        ]
        self.recvs = []

    def admitted(self, ticket: int, report: WorkerReport) -> None:
        """A receive from the ticket holder: a gloo send waits for its receive, so admitted
        gradients complete as they arrive, in any order. Directed, not any-source: a holder that
        dies before its gradient is sent breaks only its own connection."""
        while len(self.grad_bufs) < ticket:
            self.grad_bufs.append(torch.zeros_like(self.flat_grad))
        buf = self.grad_bufs[ticket - 1]
        try:
            work = self.group.recv([buf], self.members.index(report.worker + 1), P.GRAD_TAG)
        except (RuntimeError, dist.DistError):
            work = None  # its connection is gone already
        self.recvs.append((work, buf, report.worker))

    def apply(self, t: int, reports: list[WorkerReport], start: float) -> tuple[float, dict]:
        """Sum the admitted gradients as they land (and their squared norms, for the noise
        scale), average and step with the learning rate scaled to c. A gradient that never
        lands (its worker died after taking its ticket) is left out: its report is removed
        from ``reports``, so the trace censors it, and its worker is declared dead."""
        sq_norms, n, lost = 0.0, 0, []
        for work, buf, w in self.recvs:
            if not received(work):
                lost.append(w)
                continue
            self.flat_grad.copy_(buf) if n == 0 else self.flat_grad.add_(buf)
            sq_norms += float(buf.square().sum())
            n += 1
        iteration_s = time.perf_counter() - start
        if len(reports) < self.driver.chosen:
            self.grad_bufs = []  # receives left posted in this group may still land: new buffers
        if lost:
            reports[:] = [r for r in reports if r.worker not in lost]
            self.declare_dead(lost)
        live = int(self.live.sum())
        if n >= 2 and not lost:
            mean_sq = float(self.flat_grad.square().sum()) / n**2
            self.noise.update(n, self.cfg.batch_size, sq_norms, mean_sq)
        lr = scaled_lr(self.cfg, n, live, self.noise.lr_factor(n, live) if n else None)
        if n:
            self.params.step(self.flat_grad, n, lr)
        return iteration_s, {"lr": lr}

    def evaluate(self) -> float:
        return self.params.evaluate()

    def finish(self, current: int) -> None:
        """Stop the workers; a worker still sending a gradient nobody will receive fails at
        once (the group is closed) instead of at its timeout."""
        self.stop_workers(current)
        if self.group is not None:
            P.shutdown(self.group)

    def parameter_state(self) -> dict:
        return {**self.params.state(), "noise": self.noise.state_dict()}

    def load_parameter_state(self, state: dict) -> None:
        self.params.load(state)
        if "noise" in state:
            self.noise.load_state_dict(state["noise"])


def received(work: dist.Work | None) -> bool:
    """Whether a posted gradient receive completed (False: its sender's connection broke)."""
    if work is None:
        return False
    try:
        work.wait()
        return True
    except (RuntimeError, dist.DistError):
        return False
