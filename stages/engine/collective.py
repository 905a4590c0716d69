"""The collective variant of the synchronous engine: every worker holds a replica of the model and
optimizer; this process is a light coordinator that holds no parameters. It runs the policy,
announces each iteration, or a block of them at once (``cgo/<t>``, one integer a replica reads in
one round trip, saying through which iteration it holds, then ``go/<t>`` =
``"<generation>,<c or ONLINE>,<live>"``, which a replica that came early waits for; both at the
block's first iteration alone), and cuts. At the cut every
live replica enters one all-reduce of (gradient sum, sample count, ..., report slots) -- admitted
workers contribute their gradient, cut-off ones zeros (or, with ``--salvage``, the micro-batches
they finished) -- and steps (:mod:`bdsgd.stages.engine.replica`). A replica computes its next gradient
as soon as it has stepped, before it reads the next announcement (which only says how many
gradients are admitted).

Two admissions, by what the policy needs:

- *live* (``online`` policies, and adaptive ones such as ewma, ecdf, bdsgd:fixed): the
  coordinator reads the tickets of arrivals as they come (the shared admission of
  :class:`SyncEngine`), revises online, cuts, and announces the next iteration while the replicas
  all-reduce;
- *by the replicas* (full, static:C: a c that depends on nothing observed): the tickets' count
  alone cuts (ticket c sets the cut key; with every worker admitted no ticket is taken), each
  admitted replica puts its report in its slot of the all-reduce, and the lowest replica publishes
  the reduced slots with the step (``cstep/<t>``). The coordinator announces such iterations
  up to ``LOOKAHEAD`` (and ``LOOKAHEAD_S`` seconds) ahead, in blocks (each announcement says
  through which iteration the block holds, so a replica reads one per block), and the replicas
  never wait for it.

Failures: a death (a reaped process, a ticket deadline) or a replica's report that its all-reduce
failed (``cfail/<generation>``, for a member that hangs) ends the current iteration without an
update and starts a new generation among the survivors, resuming at the next iteration (after
the block, for one announced ahead: :meth:`Regrouping.regroup`): its members rebuild the group
and take the parameters and optimizer state of the member that applied the most steps, so the
replicas stay identical whichever of them had stepped.

The keys and their encodings are the wire's (:mod:`bdsgd.stages.engine.protocol`); this module
decides what to announce and when, and reads the steps; :class:`Announcer` writes the
generations and announcements, :class:`Regrouping` handles failures, :class:`StepLog` reads what
the steps tell and :class:`ReplicaOutputs` collects what else the replicas publish.
"""

from __future__ import annotations

import os
import time

import numpy as np
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.announcer import Announcer
from bdsgd.stages.engine.regroup import Regrouping
from bdsgd.stages.engine.replica_outputs import ReplicaOutputs
from bdsgd.stages.engine.step_log import StepLog
from bdsgd.stages.engine.sync import SyncEngine
from bdsgd.stages.engine.worker_report import WorkerReport
from bdsgd.stages.errors import WorkerError
from bdsgd.stages.workloads import resolve_device

STAR_MAX_PARAMS = 250_000  # auto: a star up to this model size (1 MB of float32) ...
STAR_CROWDED_MAX_PARAMS = 1_000_000  # ... or up to this one with more workers than cores
LOOKAHEAD = 64  # iterations a c that depends on nothing observed is announced ahead, at most
LOOKAHEAD_S = 0.05  # ... and no more than this much time ahead (a stop waits for them)


def allreduce_algorithm(cfg, torchrun: bool, params: int, cores: int | None = None) -> str:
    """How the replicas sum (``--allreduce``). gloo's ring all-reduce takes 2(N-1) steps, each
    waiting for the next process to be scheduled: on one machine with more processes than cores
    a step waits for a time slice, and at 6 replicas on 2 cores one all-reduce of the mlp took
    12 ms (p50) under the default scheduler. The star (the lowest replica receives every
    contribution, sums them in member order and sends the sum back) wakes each process twice:
    1.2 ms for the same. But it moves N x the model through one process: measured on one machine
    (docs/benchmarks.md, "Ring against star by model size"), it is never more than 1.07x the
    ring up to ``STAR_MAX_PARAMS``, and from 0.5M parameters on it loses (1.1-2.3x) wherever
    each process gets a core promptly, winning only while the workers outnumber the cores (up
    to ``STAR_CROWDED_MAX_PARAMS``; from 4M on the two tie there). So ``auto`` sums by star on
    one machine (not under torchrun), on the CPU, for a model of up to ``STAR_MAX_PARAMS``, or
    up to ``STAR_CROWDED_MAX_PARAMS`` when the workers are more than the machine's ``cores``;
    by ring otherwise. NCCL and gloo on CUDA tensors keep their own all-reduce."""
    if cfg.allreduce != "auto":
        return cfg.allreduce
    if torchrun or resolve_device(cfg.device, cfg.workers).type != "cpu":
        return "ring"  # (under torchrun this host's devices say nothing of the workers')
    crowded = cfg.workers > (cores if cores is not None else len(os.sched_getaffinity(0)))
    limit = STAR_CROWDED_MAX_PARAMS if crowded else STAR_MAX_PARAMS
    return "star" if params <= limit else "ring"


def publish_settings(c10d, cfg, torchrun: bool, workload, checkpointed: bool) -> None:
    """What every replica reads before it starts: how to sum, and whether to publish its state
    for checkpoints (only a run directory takes them; else they would pile up in the store)."""
    params = sum(p.numel() for p in workload.model.parameters())
    c10d.set(P.ALLREDUCE_KEY, allreduce_algorithm(cfg, torchrun, params))
    c10d.set(P.STATES_KEY, "1" if checkpointed else "0")


class Coordinator(SyncEngine):
    kind = "collective"

    def __init__(self, cfg, c10d, workload, policy, writer, alive):
        super().__init__(cfg, c10d, policy, writer, alive)
        self.last_cut = 0.0
        self.cycle_s: float | None = None  # an iteration's duration (cut to cut), smoothed
        self.steps = StepLog(c10d, self.log, self.noise, cfg.batch_size)  # what steps tell
        self.announcer = Announcer(c10d, cfg.record_batch, self.record_clock)  # what they hear
        # states, devices, digests, lags; liveness as the engine's now (the launcher replaces
        # ``alive`` once it has spawned the workers: a copy of the first one waited 30 s on dead
        # replicas for outputs they never published)
        self.outputs = ReplicaOutputs(c10d, cfg, lambda w: self.alive(w))
        self.regrouping = Regrouping(self)  # failures, and the survivors' new generation
        self.batched: dict[int, bytes] = {}  # steps of the last batch read, not yet admitted

    def connect(self) -> None:
        super().connect()
        for w in map(int, np.flatnonzero(self.live)):
            self.outputs.device_of(w)
        self.last_cut = time.perf_counter()

    # -- an iteration -------------------------------------------------------------------------
    def begin(self, t: int) -> None:
        self.steps.read_through(t, self.reads_arrivals)
        super().begin(t)

    def record(self, t: int, predicted: dict | None = None, **values) -> dict:
        """The base row, with the learning rate the replicas applied at t, which comes with
        their step (:class:`StepLog`)."""
        if "lr" not in values:
            values["lr"] = self.steps.lr_of(t)
        return super().record(t, predicted, **values)

    def before_announcing(self, first: int, last: int) -> None:
        """Decide which iterations about to be announced are followed by a record (the trace
        rows and, with a run directory, the checkpoint: :meth:`Engine.record_due`)."""
        self.announcer.decide_records(first, last)

    def record_due(self, t: int) -> bool:
        """As decided when t was announced."""
        return self.announcer.take_record(t)

    def announce(self, t: int, limit: int) -> None:
        self.announce_block(t, t, limit)

    def announce_block(self, first: int, last: int, limit: int) -> None:
        """A new generation if the live set changed, then iterations ``first..last`` at once:
        keys for ``first`` alone, which say through which iteration they hold."""
        self.new_generation(first)
        self.announcer.limit = limit
        self.announcer.write(first, last, self.reads_arrivals)

    def new_generation(self, resume: int) -> None:
        if self.announcer.new_generation(self.live, resume):
            self.batched = {}  # (a new generation may run them again: read what it publishes)

    @property
    def reads_arrivals(self) -> bool:
        """Whether the policy needs the arrivals as they come (online revision, or a c that
        depends on the last iteration: it is chosen while the replicas all-reduce); else the
        replicas' tickets decide alone and the reports ride the all-reduce."""
        return self.policy.online or self.policy.adaptive

    def ahead(self, t: int) -> int:
        """A c that depends on nothing observed is announced ahead, a block at a time: once
        fewer than half of the window remain announced past the replicas' front (the last
        step read: a batch of them is read at once), through the front + window. The window is
        ``LOOKAHEAD`` iterations, fewer where those would take longer than ``LOOKAHEAD_S``
        (none before an iteration was timed): the replicas run every announced iteration
        before they see a stop, so a Ctrl-C on slow iterations waits for few of them, while
        fast ones, where a round trip per iteration would show, are read a block at a time."""
        if self.reads_arrivals or self.stop_pending or self.cycle_s is None:
            return 0
        window = min(LOOKAHEAD, int(LOOKAHEAD_S / max(self.cycle_s, 1e-9)))
        front = max(t, max(self.batched, default=t))  # the replicas are past every step read
        announced = self.progress.announced
        if announced >= front + window // 2:
            return announced - t  # nothing new to announce
        return min(front + window, self.cfg.iterations - 1) - t

    def admit(self, t: int) -> list[WorkerReport]:
        """An online iteration reads arrivals as they come (the shared admission); a fixed-c
        one is decided by the replicas' tickets alone, and its admitted reports arrive with
        the lowest replica's step, in ticket order (arrival order when nobody could be cut)."""
        if self.reads_arrivals:
            return super().admit(t)
        self.progress.admitting = t
        blob = self.wait_step(t)
        self.progress.admitting = None
        if blob is None:
            return []
        step = P.decode_step(blob)
        self.steps.took(t, step)
        slots = step.reports
        slots.sort(key=lambda s: (s[0], s[1].start_s + s[1].runtime_s))
        reports = [report for _, report in slots]
        for report in reports:
            self.driver.arrive(report.worker, report.runtime_s)
        return reports

    def wait_step(self, t: int) -> bytes | None:
        """The step the lowest replica published after iteration t's all-reduce, read with the
        rest of its batch (one wait and one get per batch of up to ``P.STEP_BATCH``, two gets
        when the wait starts inside one); None when the iteration failed (a death, a failed
        all-reduce) or nothing came by the deadline (then the members that did not report a
        failure are declared hung). A batch may wait for all its iterations: the deadline is
        one ``--timeout`` for each iteration it may hold."""
        if t in self.batched:
            return self.batched.pop(t)
        held = min(P.STEP_BATCH, max(self.progress.announced - t + 1, 1))
        deadline = time.monotonic() + self.cfg.timeout_s * held
        key = P.step_key(t)
        while True:
            if P.wait_key(self.c10d, key, 0.05):
                self.batched = self.read_batch(key)
                if t in self.batched:
                    return self.batched.pop(t)
                time.sleep(0.05)  # (a pointer an earlier generation left: t's step is to come)
            self.poll()
            if not self.progress.aborted and self.regrouping.never_ran(t):
                self.progress.aborted = True  # (ended without an update)
            if self.progress.aborted:
                return None
            if time.monotonic() > deadline:
                self.regrouping.handle_failure()
                return None

    def read_batch(self, key: str) -> dict[int, bytes]:
        """The batch of steps ``key`` holds or points to (:func:`batch_values`)."""
        value = self.c10d.get(key)
        first = P.batch_pointer(value)
        return P.decode_batch(value if first is None else self.c10d.get(P.step_key(first)))

    def apply(self, t: int, reports: list[WorkerReport], start: float) -> tuple[float, dict]:
        """The replicas apply the update themselves; the coordinator only times the cycle
        (cut to cut); the learning rate they applied comes with their step (:meth:`record`)."""
        now = time.perf_counter()
        iteration_s, self.last_cut = now - self.last_cut, now
        self.cycle_s = (
            iteration_s if self.cycle_s is None else 0.8 * self.cycle_s + 0.2 * iteration_s
        )
        if t % self.cfg.eval_every == 0:
            self.steps.eval_due(t)
        if self.progress.aborted:
            # no replica stepped, and none publishes a state for a record decided here
            self.announcer.records.discard(t)
            return iteration_s, {"lr": 0.0, "c": 0}
        return iteration_s, {} if reports else {"lr": 0.0}  # (nothing admitted: no step)

    def iteration_keys(self, t: int) -> list[str]:
        # (a state published for a record the coordinator did not take: a stop rule, an
        # iteration ended without an update after the replicas applied it)
        recorded = (
            [P.record_key(t + 1), P.replica_key(t + 1)]
            if (t + 1) % self.cfg.record_batch == 0
            else []
        )
        started, cut = self.announcer.retire(t)
        announced = [P.announce_key(t)] if started else []
        if self.reads_arrivals:  # (announced one by one, tickets read live; read_noise deletes
            return [*super().iteration_keys(t), *announced, *recorded]  # the step)
        # a fixed c: only the keys its iteration made (a delete is a round trip, made or not)
        made = [P.go_key(t)] if started else []
        made += [P.ticket_key(t), P.cut_key(t)] if cut else []
        return [*made, *announced, P.step_key(t), *recorded]

    # -- failures (:class:`Regrouping`) -----------------------------------------------------
    def poll(self) -> None:
        """While waiting for a ticket: deaths, and replicas whose all-reduce failed."""
        self.reap()
        if not self.progress.aborted and self.regrouping.failure_reported():
            self.regrouping.handle_failure()

    def on_dead(self, workers: list[int]) -> None:
        """Regroup the survivors (:meth:`Regrouping.regroup`)."""
        self.regrouping.regroup()

    # -- held-out loss, state, end ------------------------------------------------------------
    def state(self, next_iteration: int) -> dict:
        """The base state, at the iterations the lowest replica has applied (its step count:
        iterations with an update). They differ from the coordinator's count after iterations
        without an update, when the run ended without :meth:`run_announced` (a second Ctrl-C,
        a failure at the end) or was cut short mid-all-reduce."""
        self.outputs.fetch_state(next_iteration)
        if not self.outputs.finished:  # (the step before a state is published before it: its lr)
            self.steps.read_through(next_iteration, self.reads_arrivals)
        replica = self.outputs.replica
        return super().state(replica[0] if replica is not None else next_iteration)

    def parameter_state(self) -> dict:
        return self.outputs.parameter_state()

    def load_parameter_state(self, state: dict) -> None:
        if "replica" not in state:
            raise WorkerError("the checkpoint holds no replica state: the run cannot resume")
        blob = state["replica"].numpy().tobytes()
        self.c10d.set(P.replica_key("init"), blob)
        replica = P.decode_replica_state(blob)
        if "noise" in replica:
            self.noise.load_state_dict(replica["noise"])
        self.steps.next = int(state["next_iteration"])

    def finish(self, current: int) -> None:
        """Tell the replicas to stop after ``current``; collect the held-out losses, the final
        state, join lags and parameter digests they publish (bounded)."""
        self.outputs.finished = True
        self.stop_workers(current)
        try:
            self.outputs.collect(self.announcer.generation >= 0, self.live, self.collect_evals)
        except RuntimeError:
            pass  # the store is gone: workers notice and exit on their own

    def collect_evals(self, wait_s: float) -> None:
        """The held-out losses still due, waiting up to ``wait_s`` in all."""
        self.steps.collect_evals(self.next_iteration, self.reads_arrivals, wait_s)

    def final_loss(self) -> float | None:
        return self.outputs.final_loss()

    def trace_device(self, worker: int) -> str:
        return self.outputs.device_of(worker)

    def extras(self) -> dict:
        """What the summary reports of the collective engine."""
        return {**super().extras(), **self.outputs.summary()}
