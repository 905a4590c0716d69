"""The collective engine's worker: a full replica of the model and optimizer. Each iteration it
waits for the coordinator's announcement, computes its gradient (abandoning it at the cut), takes
a ticket, and enters one all-reduce of

    [gradient sum over its samples..., samples, |g_i|^2, contributions, held-out loss,
     evaluators, report slots...]

with every live replica: admitted workers contribute their gradient, cut-off workers zeros (or,
with ``--salvage``, the micro-batches they finished). Every replica divides by the admitted sample
count and steps torch's SGD with momentum (:func:`bdsgd.stages.engine.config.sgd`, as the
parameter server does) on the model's parameters, whose gradients are views into the reduced
buffer -- the same arithmetic on the same reduced bytes, so the replicas stay bit-identical.

The held-out loss after an iteration that is due (``--eval-every``) is computed by every member on
its slice of the held-out batch right after the step, and summed by the next iteration's
all-reduce, which carries it anyway: on 2 cores that the replicas fill, one replica evaluating the
whole batch held the others at the sum for that long (about 8% of the iterations per second of 2
workers). The lowest replica publishes it with that iteration's step.

See :mod:`bdsgd.stages.engine.collective` for the coordinator and the failure protocol.
"""

from __future__ import annotations

import hashlib
import time

import torch
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.config import scaled_lr, sgd
from bdsgd.stages.engine.replica_membership import Membership
from bdsgd.stages.engine.replica_steps import StepPublisher, eval_rows
from bdsgd.stages.engine.worker import (
    WorkerProcess,
    WorkerSpec,
    worker_entry,
    workload_code,
)
from bdsgd.stages.engine.worker_report import SLOT, WorkerReport
from bdsgd.stages.goodput import NoiseScale
from bdsgd.stages.workloads import backend_for, resolve_device

SCALARS = 5  # samples, |g_i|^2, contributions, held-out loss (a member's part), evaluators


class Replica(WorkerProcess):
    def __init__(self, spec: WorkerSpec):
        device = resolve_device(spec.cfg.device, spec.cfg.workers, spec.local_rank)
        super().__init__(spec, device)
        self.backend = backend_for(device, spec.cfg.workers)
        P.vote_backend(self.c10d, self.backend)
        self.c10d.set(P.device_key(self.w), device.type)
        size = sum(p.numel() for p in self.model.parameters())
        kw = dict(device=device)
        self.flat = torch.zeros(size, **kw)  # the parameters (the model's params are views)
        self.momentum = torch.zeros(size, **kw)
        # the all-reduce: [gradient..., samples, |g_i|^2, contributions, held-out loss part,
        # evaluators, report slots...]; the model's gradients are views into its head, so
        # backward writes what is reduced
        self.comm = torch.zeros(size + SCALARS + SLOT * spec.cfg.workers, **kw)
        self.grad, self.comm_scalars = self.comm[:size], self.comm[size : size + SCALARS]
        self.comm_slots = self.comm[size + SCALARS :]
        P.bind_flat(self.model.parameters(), self.flat, self.grad)
        # the update: torch's SGD on the parameters (views into flat), its momentum buffers views
        # into one flat buffer, which a new generation broadcasts and the state saves whole
        self.opt = sgd(self.model.parameters(), lr=spec.cfg.lr, momentum=spec.cfg.momentum)
        bind_momentum(self.opt, self.momentum)
        self.scalars_cpu = torch.zeros(SCALARS)
        self.slot = slice(SLOT * self.w, SLOT * (self.w + 1))  # this worker's, in comm_slots
        self.cuttable = True  # whether the last iteration could cut anyone
        self.live_arrivals = 1  # whether the coordinator reads this iteration's arrivals live
        self.known, self.known_through = (-1, 0, 1), -1  # an announcement, and through when
        self.noise = NoiseScale()
        self.steps = 0  # iterations applied
        self.noise_stats: tuple = ()  # the last step's (n, sum |g_i|^2, |mean|^2, samples)
        self.lr: float | None = None  # the learning rate the last step applied (None: no step)
        self.lags_ms: list[float] = []
        self.eval_part: tuple[int, float] | None = None  # (iteration, this slice's loss part)
        self.evaluated: tuple[int, float] | None = None  # the last all-reduce's held-out loss
        star = self.c10d.get(P.ALLREDUCE_KEY) == b"star" and device.type == "cpu"
        self.checkpointed = self.c10d.get(P.STATES_KEY) == b"1"  # a run directory takes states
        self.steps_out = StepPublisher(self.c10d)  # the steps on their way to the coordinator
        self.membership = Membership(self, self.backend, star)  # the generation and its group

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        t = int(self.c10d.get(P.START_KEY).decode())
        if t > 0:
            self.load(P.decode_replica_state(self.c10d.get(P.replica_key("init"))))
        self.mark_ready()
        ahead = None  # iteration t's gradient, computed before its announcement was read
        while t < self.spec.cfg.iterations:
            announced = self.announcement(t)
            if announced is None:
                break
            generation, limit, self.live_arrivals = announced
            if generation > self.membership.generation:
                t, ahead = self.join(generation), None
                continue  # (re-)read the announcement of the iteration the generation resumes at
            t = self.iteration(t, limit, ahead)
            ahead = self.compute_ahead(t)
        self.finish()

    def announcement(self, t: int) -> tuple[int, int, int] | None:
        """(generation, c or ONLINE, whether the coordinator reads arrivals live) of iteration
        t, or None for stop. No round trip inside a block announced ahead, one when the
        coordinator announced already (the integer key), else a wait for the text key."""
        if t <= self.known_through:
            return self.known
        code = self.c10d.add(P.announce_key(t), 0)
        if not code:  # not announced yet: wait for the text, written after the integer
            if self.wait_announcement(t) == P.STOP:
                return None
            code = self.c10d.add(P.announce_key(t), 0)
        generation, limit, live, span = P.decode_announcement(code)
        self.known, self.known_through = (generation, limit, live), t + span
        return self.known

    def compute_ahead(self, t: int):
        """Iteration t's gradient, started as soon as the step before it is applied: the
        replica holds the parameters already, so it need not wait for the announcement, which
        only says how many gradients are admitted. Cut checks as in the last iteration."""
        if t >= self.spec.cfg.iterations:
            return None
        return self.compute(t, P.cut_key(t), cuttable=self.cuttable)

    def iteration(self, t: int, limit: int, grad=None) -> int:
        """Compute (unless done ahead), take a ticket, all-reduce, step; returns the next
        iteration (the resume point of a new generation when the all-reduce failed)."""
        workers = len(self.membership.members)
        self.online = limit == P.ONLINE
        limit = workers if self.online else limit
        self.cuttable = self.online or limit < workers
        if grad is None:
            grad = self.compute(t, P.cut_key(t), cuttable=self.cuttable)
        report = self.report(t, grad)
        ticket = self.admission(t, limit, workers, report) if grad.loss is not None else 0
        self.contribute(grad.samples if ticket or self.spec.cfg.salvage else 0, report, ticket)
        entered = time.time()
        if not self.membership.all_reduce(self.comm):
            return self.join(self.membership.recover())
        self.steps_out.survived()
        if not ticket:
            self.note_lag(t, entered)
        self.step()
        self.publish(t)
        if t % self.spec.cfg.eval_every == 0:
            self.eval_part = (t, self.evaluate_slice())  # (summed by the next all-reduce)
        return t + 1

    def admission(self, t: int, limit: int, workers: int, report) -> int:
        """This replica's ticket (0: cut off; 1 when its number does not matter). When the
        coordinator reads arrivals live (online, or an adaptive c), the shared ticket protocol;
        otherwise only the tickets' count matters (ticket c cuts the rest) and the reports ride
        the all-reduce; with every worker admitted nobody can be cut, and no ticket is taken."""
        if self.live_arrivals:
            return 1 if self.take_ticket(t, limit, report) else 0
        if limit >= workers:
            return 1
        ticket = self.c10d.add(P.ticket_key(t), 1)
        if ticket == limit:
            self.c10d.set(P.cut_key(t), repr(time.time()))
        return ticket if ticket <= limit else 0

    # -- the update ---------------------------------------------------------------------------
    def contribute(self, samples: int, report: WorkerReport, ticket: int) -> None:
        """This replica's part of the all-reduce: its gradient (already in place: the gradient
        buffer holds the sum over the ``samples`` done divided by the batch size) or zeros; an
        admitted gradient also adds its squared norm for the noise-scale estimate, and its
        report in its slot (the coordinator of a fixed-c iteration reads the reports there)."""
        self.comm_slots.zero_()
        if ticket:
            slot = torch.from_numpy(report.to_slot(ticket))
            self.comm_slots[self.slot] = slot.to(self.device)
        if not samples:
            self.grad.zero_()
        sq_norm = float(torch.dot(self.grad, self.grad)) if ticket and samples else 0.0
        part = self.eval_part[1] if self.eval_part is not None else 0.0
        evaluators = float(self.eval_part is not None)
        self.scalars_cpu.numpy()[:] = (float(samples), sq_norm, float(bool(ticket and samples)),
                                       part, evaluators)  # fmt: skip
        self.comm_scalars.copy_(self.scalars_cpu)

    def step(self) -> None:
        """torch's SGD with momentum on the mean of the admitted gradients (the model's
        gradients are views into the reduced buffer), the learning rate scaled to the admitted
        count."""
        cfg = self.spec.cfg
        samples, sq_norms, contributions, loss, evaluators = self.comm_scalars.tolist()
        self.take_evaluated(loss, evaluators)
        self.noise_stats, self.lr = (), None
        if samples <= 0:
            return
        grad = self.grad.mul_(cfg.batch_size / samples)  # the mean over the admitted samples
        stats = (int(contributions), sq_norms, float(torch.dot(grad, grad)), int(samples))
        self.noise.update(stats[0], cfg.batch_size, *stats[1:3], mean_samples=stats[3])
        self.noise_stats = stats
        gradients = samples / cfg.batch_size
        members = len(self.membership.members)
        gain = self.noise.lr_factor(max(round(gradients), 1), members)
        self.lr = scaled_lr(cfg, gradients, members, gain)
        for group in self.opt.param_groups:
            group["lr"] = self.lr
        self.opt.step()
        self.steps += 1

    def take_evaluated(self, loss: float, evaluators: float) -> None:
        """The held-out loss the all-reduce summed, when every member added its slice's part."""
        due, self.eval_part = self.eval_part, None
        whole = due is not None and round(evaluators) == len(self.membership.members)
        self.evaluated = (due[0], loss) if whole else None

    # -- generations (:class:`Membership`) -----------------------------------------------------
    def join(self, generation: int) -> int:
        """Join ``generation`` (:meth:`Membership.join`); returns the iteration it resumes at."""
        self.known_through = -1  # read the announcements again: a block may predate the group
        self.eval_part = None  # (of the last group: the coordinator goes without it)
        return self.membership.join(generation)

    # -- what the coordinator reads -----------------------------------------------------------
    def note_lag(self, t: int, entered: float) -> None:
        """Cut-off: milliseconds from the cut (the time the cut key holds) to this replica's
        entry into the all-reduce; read after it, off the critical path."""
        cut = self.c10d.get(P.cut_key(t)) if self.c10d.check([P.cut_key(t)]) else None
        if cut is not None:
            self.lags_ms.append(max(entered - float(cut.decode()), 0.0) * 1e3)

    def publish(self, t: int) -> None:
        """The step (:class:`StepPublisher`) and, by the lowest replica when the run has a run
        directory, its state at each checkpoint the coordinator decided on (it takes and deletes
        the state; a run without one would pile them up in the store)."""
        lowest = self.membership.lowest
        self.steps_out.add(t, self.step_parts(), lowest, bool(self.live_arrivals),
                           block_end=t >= self.known_through)  # fmt: skip
        boundary = (t + 1) % self.spec.cfg.record_batch == 0
        if lowest and self.checkpointed and boundary:
            if self.c10d.check([P.record_key(t + 1)]):
                self.c10d.set(P.replica_key(t + 1), self.state_bytes())

    def step_parts(self) -> tuple:
        """The last all-reduce as it is published: the arguments of
        :func:`bdsgd.stages.engine.protocol.encode_step` (the reduced slots copied out of the
        buffer the next all-reduce reuses; the learning rate applied, which the coordinator
        logs)."""
        slots = self.comm_slots.cpu().numpy().tobytes()
        return self.noise_stats, slots, self.evaluated, self.lr

    def evaluate_due(self) -> None:
        """At the end: the held-out loss due after the last iteration, which no all-reduce
        followed to sum it (the lowest replica evaluates the whole batch)."""
        if self.eval_part is not None:
            self.c10d.set(P.eval_key(self.eval_part[0]), repr(self.evaluate()))
            self.eval_part = None

    def finish(self) -> None:
        self.steps_out.publish(self.membership.lowest, every=True)
        self.c10d.set(P.lag_key(self.w), ",".join(f"{v:.4f}" for v in self.lags_ms))
        digest = hashlib.sha256(self.flat.cpu().numpy().tobytes()).hexdigest()
        self.c10d.set(P.digest_key(self.w), digest)
        if self.membership.lowest:
            self.evaluate_due()
            self.c10d.set(P.eval_key("final"), repr(self.evaluate()))
            self.c10d.set(P.replica_key("final"), self.state_bytes())
        self.membership.leave()

    def evaluate(self) -> float:
        return self.evaluate_rows(slice(None), 1.0)

    def evaluate_slice(self) -> float:
        """This member's part of the held-out loss: the loss of its slice of the held-out batch
        (members split it in order) weighted by the slice's share, so the parts sum to the
        whole batch's loss for a loss that averages over samples (as the built-in workloads')."""
        members = self.membership.members
        rank, size = members.index(self.spec.worker_id), len(members)
        rows, share = eval_rows(len(self.workload.eval_batch[1]), rank, size)
        return self.evaluate_rows(rows, share) if share else 0.0

    @torch.no_grad()
    def evaluate_rows(self, rows: slice, weight: float) -> float:
        x, y = self.workload.eval_batch
        x, y = x[rows].to(self.device), y[rows].to(self.device)
        with workload_code():
            return float(self.workload.loss(self.model(x), y)) * weight

    def state_bytes(self) -> bytes:
        state = {"params": self.flat.cpu(), "momentum": self.momentum.cpu(), "steps": self.steps}
        return P.encode_replica_state({**state, "noise": self.noise.state_dict(), "lr": self.lr})

    def load(self, state: dict) -> None:
        self.flat.copy_(state["params"].to(self.device))
        self.momentum.copy_(state["momentum"].to(self.device))
        self.steps = int(state["steps"])
        if "noise" in state:
            self.noise.load_state_dict(state["noise"])


def bind_momentum(opt: torch.optim.SGD, flat: torch.Tensor) -> None:
    """Make ``opt``'s momentum buffers views into ``flat`` (in parameter order): torch's SGD
    updates a buffer it finds in place, so ``flat`` holds the momentum of every parameter."""
    params = [p for group in opt.param_groups for p in group["params"]]
    for p, buf in zip(params, P.flat_views(flat, params), strict=True):
        opt.state[p]["momentum_buffer"] = buf


def replica_main(spec: WorkerSpec) -> None:
    worker_entry(lambda s: Replica(s).run(), spec)
