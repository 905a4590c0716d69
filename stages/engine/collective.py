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
the block, for one announced ahead: :meth:`Coordinator.on_dead`): its members rebuild the group
and take the parameters and optimizer state of the member that applied the most steps, so the
replicas stay identical whichever of them had stepped.

The keys and their encodings are the wire's (:mod:`bdsgd.stages.engine.protocol`); this module
decides what to announce and when, and reads what the replicas publish.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.base import HUNG, interrupts_deferred
from bdsgd.stages.engine.step_log import StepLog
from bdsgd.stages.engine.sync import SyncEngine
from bdsgd.stages.engine.worker_report import WorkerReport
from bdsgd.stages.errors import WorkerError
from bdsgd.stages.workloads import resolve_device

FAIL_GRACE_S = 5.0  # after a failure report, how long the other members have to report too
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
        self.generation = -1
        self.members: list[int] = []
        self.last_cut = 0.0
        self.cycle_s: float | None = None  # an iteration's duration (cut to cut), smoothed
        self.steps = StepLog(c10d, self.log, self.noise, cfg.batch_size)  # what steps tell
        self.replica: tuple[int, bytes] | None = None  # (steps, state) last fetched
        self.lags_ms: list[float] = []
        self.digests: dict[int, str] = {}
        self.devices: dict[int, str] = {}  # worker -> the device type it computes on
        self.finished = False
        self.batched: dict[int, bytes] = {}  # steps of the last batch read, not yet admitted
        self.checkpointed = c10d.get(P.STATES_KEY) == b"1"  # a run directory takes states
        self.records: set[int] = set()  # iterations after which the rows and state are written
        self.limit = 0  # the limit last announced
        self.block_starts: set[int] = set()  # iterations whose announcement keys were written
        self.cuttable: set[int] = set()  # iterations announced with c below the live count
        self.resume_at = -1  # where the last regrouping of a block announced ahead resumed

    def connect(self) -> None:
        super().connect()
        for w in map(int, np.flatnonzero(self.live)):
            self.device_of(w)
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
        """Decide which of the iterations about to be announced are followed by a record (the
        trace rows and, with a run directory, the checkpoint: :meth:`Engine.record_due`), and
        tell the lowest replica, which publishes its state only there, before any of them is
        announced: a replica running a block ahead reads the decision after the iteration."""
        for k in range(first, last + 1):
            if (k + 1) % self.cfg.record_batch == 0 and self.record_clock():
                self.records.add(k)
                if self.checkpointed:
                    self.c10d.set(P.record_key(k + 1), "1")

    def record_due(self, t: int) -> bool:
        """As decided when t was announced."""
        if t in self.records:
            self.records.discard(t)
            return True
        return False

    def announce(self, t: int, limit: int) -> None:
        self.announce_block(t, t, limit)

    def announce_block(self, first: int, last: int, limit: int) -> None:
        """A new generation if the live set changed, then iterations ``first..last`` at once:
        keys for ``first`` alone, which say through which iteration they hold."""
        self.new_generation(first)
        self.limit = limit
        self.write_announcement(first, last)

    def write_announcement(self, first: int, last: int) -> None:
        """Iterations ``first..last`` of the current generation, with the last limit announced,
        and whether the coordinator reads arrivals live: as one integer for the replicas'
        one-round-trip read (set, not added: a regrouping announces again over an older one),
        then as text, which a replica that came early waits for (it then reads the integer)."""
        live = int(self.reads_arrivals)
        code = P.encode_announcement(self.generation, self.limit, live, last - first)
        self.c10d.set(P.announce_key(first), str(code))
        self.c10d.set(P.go_key(first), f"{self.generation},{self.limit},{live}")
        self.block_starts.add(first)
        if self.limit < len(self.members):  # the replicas take tickets, and cut
            self.cuttable.update(range(first, last + 1))

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
        if self.announced >= front + window // 2:
            return self.announced - t  # nothing new to announce
        return min(front + window, self.cfg.iterations - 1) - t

    def admit(self, t: int) -> list[WorkerReport]:
        """An online iteration reads arrivals as they come (the shared admission); a fixed-c
        one is decided by the replicas' tickets alone, and its admitted reports arrive with
        the lowest replica's step, in ticket order (arrival order when nobody could be cut)."""
        if self.reads_arrivals:
            return super().admit(t)
        self.admitting = t
        blob = self.wait_step(t)
        self.admitting = None
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
        held = min(P.STEP_BATCH, max(self.announced - t + 1, 1))
        deadline = time.monotonic() + self.cfg.timeout_s * held
        key = P.step_key(t)
        while True:
            if P.wait_key(self.c10d, key, 0.05):
                self.batched = self.read_batch(key)
                if t in self.batched:
                    return self.batched.pop(t)
                time.sleep(0.05)  # (a pointer an earlier generation left: t's step is to come)
            self.poll()
            if not self.aborted and self.never_ran(t):
                self.aborted = True  # (ended without an update)
            if self.aborted:
                return None
            if time.monotonic() > deadline:
                self.handle_failure()
                return None

    def never_ran(self, t: int) -> bool:
        """Whether iteration t, of a block the replicas ran ahead when a regrouping ended it,
        has no step and never will: every member of the new generation has joined it, and each
        published the steps it held before it joined. The iteration ends without an update."""
        if t >= self.resume_at:
            return False
        joined = self.c10d.add(P.joined_key(self.generation), 0)
        return joined >= len(self.members) and not self.c10d.check([P.step_key(t)])

    def read_batch(self, key: str) -> dict[int, bytes]:
        """The batch of steps ``key`` holds or points to (:func:`batch_values`)."""
        value = self.c10d.get(key)
        first = P.batch_pointer(value)
        return P.decode_batch(value if first is None else self.c10d.get(P.step_key(first)))

    def new_generation(self, resume: int) -> None:
        members = (np.flatnonzero(self.live) + 1).tolist()
        if members == self.members:
            return
        self.generation += 1
        self.members = members
        self.batched = {}  # (a new generation may run them again: read what it publishes)
        self.c10d.set(P.generation_key(self.generation), f"{P.encode_members(members)};{resume}")

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
        if self.aborted:
            # no replica stepped, and none publishes a state for a record decided here
            self.records.discard(t)
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
        started, cut = t in self.block_starts, t in self.cuttable
        self.block_starts.discard(t)
        self.cuttable.discard(t)
        announced = [P.announce_key(t)] if started else []
        if self.reads_arrivals:  # (announced one by one, tickets read live; read_noise deletes
            return [*super().iteration_keys(t), *announced, *recorded]  # the step)
        # a fixed c: only the keys its iteration made (a delete is a round trip, made or not)
        made = [P.go_key(t)] if started else []
        made += [P.ticket_key(t), P.cut_key(t)] if cut else []
        return [*made, *announced, P.step_key(t), *recorded]

    # -- failures -----------------------------------------------------------------------------
    def poll(self) -> None:
        """While waiting for a ticket: deaths, and replicas whose all-reduce failed."""
        self.reap()
        if not self.aborted and self.c10d.check([P.fail_key(self.generation)]):
            self.handle_failure()

    @interrupts_deferred()
    def handle_failure(self) -> None:
        """A member's all-reduce failed: every member that is alive reports it within a grace;
        the ones that do not are hung, and declared dead. Ctrl-C waits for the regrouping: the
        members that reported wait for the next generation, not for the stop."""
        grace = time.monotonic() + min(self.cfg.timeout_s, FAIL_GRACE_S)
        members = set(np.flatnonzero(self.live).tolist())
        while time.monotonic() < grace:
            self.reap()
            reported = self.failed_members() | set(np.flatnonzero(~self.live).tolist())
            if members <= reported:
                break
            time.sleep(0.05)
        hung = members - self.failed_members()
        self.declare_dead(sorted(hung), HUNG)
        if not hung:  # a failure nobody caused (a network blip): rebuild all the same
            self.on_dead([])

    def failed_members(self) -> set[int]:
        if not self.c10d.check([P.fail_key(self.generation)]):
            return set()
        blob = self.c10d.get(P.fail_key(self.generation)).decode()
        return {int(w) for w in blob.split(",") if w}

    @interrupts_deferred()
    def on_dead(self, workers: list[int]) -> None:
        """Regroup the survivors. Online, found while an iteration runs, it ends without an
        update and the new group resumes at the next one; found before it is announced, the new
        group runs it. A block announced ahead, which the replicas run without waiting for the
        coordinator, is left to them: the new group resumes after it, the coordinator reads the
        steps the survivors ran (they publish them, the lowest's unpublished ones too) and ends
        the rest without an update (:meth:`never_ran`), so no update is applied twice, nor
        applied without being logged. The generation lands whole under Ctrl-C (replicas whose
        all-reduce failed wait for it)."""
        if not self.reads_arrivals:
            resume = self.resume_at = max(self.announced, self.begun) + 1
        elif self.admitting is not None:
            self.aborted = True
            self.c10d.set(P.cut_key(self.admitting), repr(time.time()))
            resume = self.admitting + 1
        else:  # found between iterations: the new group runs the coming one
            resume = self.begun + 1
        self.members = []  # force a new generation even if nobody died (failure without death)
        self.new_generation(resume)
        if not self.reads_arrivals and resume < self.cfg.iterations:
            # announced now (or the stop): survivors that finished the block wait for it
            if self.stop_pending:
                self.c10d.set(P.go_key(resume), P.STOP)
            else:
                self.before_announcing(resume, resume)
                self.write_announcement(resume, resume)
                self.announced = resume
        elif resume <= self.announced:  # (a block announced ahead: its keys are at its start)
            self.write_announcement(resume, self.announced)

    # -- held-out loss, state, end ------------------------------------------------------------
    def state(self, next_iteration: int) -> dict:
        """The base state, at the iterations the lowest replica has applied (its step count:
        iterations with an update). They differ from the coordinator's count after iterations
        without an update, when the run ended without :meth:`run_announced` (a second Ctrl-C,
        a failure at the end) or was cut short mid-all-reduce."""
        self.fetch_replica(next_iteration)
        if not self.finished:  # (the step before a state is published before it: its lr)
            self.steps.read_through(next_iteration, self.reads_arrivals)
        steps = self.replica[0] if self.replica is not None else next_iteration
        return super().state(steps)

    def fetch_replica(self, steps: int) -> None:
        """The lowest replica's state after ``steps`` iterations (bounded wait); at the end,
        whatever it published last."""
        if self.finished or (self.replica is not None and self.replica[0] == steps):
            return
        if P.wait_key(self.c10d, P.replica_key(steps), self.cfg.timeout_s):
            self.replica = (steps, self.c10d.get(P.replica_key(steps)))
            self.c10d.delete_key(P.replica_key(steps))  # the store keeps no pile of states

    def parameter_state(self) -> dict:
        if self.replica is None:
            return {}
        return {"replica": torch.frombuffer(bytearray(self.replica[1]), dtype=torch.uint8)}

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
        self.finished = True
        self.stop_workers(current)
        try:
            self.collect_final()
        except RuntimeError:
            pass  # the store is gone: workers notice and exit on their own

    def collect_final(self) -> None:
        """What the replicas publish as they stop, within one bound: a replica that does not
        stop is killed by the launcher after it, so its lateness costs the user one wait."""
        deadline = time.monotonic() + min(self.cfg.timeout_s, 30.0)

        def left() -> float:
            return max(deadline - time.monotonic(), 0.01)

        # (no generation was announced: stopped during start-up, no replica holds a state)
        if self.generation >= 0 and self.wait_published(P.replica_key("final"), left):
            blob = self.c10d.get(P.replica_key("final"))
            self.replica = (int(P.decode_replica_state(blob)["steps"]), blob)
        self.steps.collect_evals(self.next_iteration, self.reads_arrivals, min(1.0, left()))
        for w in map(int, np.flatnonzero(self.live)):
            if self.wait_published(P.digest_key(w), left):
                self.digests[w] = self.c10d.get(P.digest_key(w)).decode()
            if self.c10d.check([P.lag_key(w)]):
                blob = self.c10d.get(P.lag_key(w)).decode()
                self.lags_ms += [float(v) for v in blob.split(",") if v]

    def wait_published(self, key: str, left) -> bool:
        """Whether ``key`` appears before ``left()`` runs out, or every worker process is gone
        (a Ctrl-C during start-up can end them before they publish anything)."""
        while not P.wait_key(self.c10d, key, min(0.1, left())):
            if left() <= 0.01 or not any(map(self.alive, range(self.cfg.workers))):
                return self.c10d.check([key])
        return True

    def final_loss(self) -> float | None:
        if self.c10d.check([P.eval_key("final")]):
            return float(self.c10d.get(P.eval_key("final")).decode())
        return None

    def trace_device(self, worker: int) -> str:
        return self.device_of(worker)

    def device_of(self, worker: int) -> str:
        """The device ``worker`` reported (set before it counts as ready; read without waiting:
        on a resumed run a worker dead at the checkpoint may count instead of a slow live one,
        which reports by the time it computes). ``--device`` where it has not reported."""
        if worker not in self.devices and self.c10d.check([P.device_key(worker)]):
            self.devices[worker] = self.c10d.get(P.device_key(worker)).decode()
        return self.devices.get(worker, self.cfg.device if self.cfg.device != "auto" else "cpu")

    def extras(self) -> dict:
        """What the summary reports of the collective engine."""
        lags = np.asarray(self.lags_ms) if self.lags_ms else np.zeros(1)
        return {
            **super().extras(),
            "join_lag_ms_p50": float(np.percentile(lags, 50)),
            "join_lag_ms_p99": float(np.percentile(lags, 99)),
            "replicas_identical": len(set(self.digests.values())) <= 1,
            "replica_digests": {str(k): v for k, v in self.digests.items()},
            "device": ",".join(sorted(set(self.devices.values()))),  # "cpu,cuda": a mix
        }
