"""What the collective replicas' published steps tell the coordinator: each step's gradient
statistics feed the noise-scale estimate, in order; the held-out loss a step's all-reduce summed
and the learning rate it applied go into the log rows of their iterations. A step may be read
before its iteration's row is recorded (a fixed c's, with its reports; an online one's, as the
next iteration begins) or after it (then the row is filled in when it is read).
"""

from __future__ import annotations

import time

import torch.distributed as dist
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.base import IterationLog
from bdsgd.stages.goodput import NoiseScale


class StepLog:
    """The coordinator's reading of the steps, and the log values that wait for them."""

    def __init__(self, c10d: dist.Store, log: IterationLog, noise: NoiseScale, batch_size: int):
        self.c10d, self.log, self.noise, self.batch_size = c10d, log, noise, batch_size
        self.next = 0  # the first iteration whose step is not yet read
        self.read: dict[int, P.Step] = {}  # steps read with their reports (a fixed c's)
        self.pending_evals: dict[int, int] = {}  # iteration -> its index in the log
        self.lrs: dict[int, float | None] = {}  # steps read before their log row
        self.pending_lrs: dict[int, int] = {}  # iteration -> its log row, awaiting its step
        self.resumed_at = 0  # read live: the last regrouping's resume; a step before it may be lost
        self.joining: tuple[int, int] | None = None  # its (generation, members) until all joined

    def took(self, t: int, step: P.Step) -> None:
        """Step t, read with its reports (a fixed c's): kept for :meth:`read_through`."""
        self.read[t] = step._replace(reports=[])
        self.take_lr(t, step.lr)

    def read_through(self, t: int, online: bool, final: bool = False) -> None:
        """Feed the noise-scale estimate the statistics of the steps before t, in order (those
        :meth:`took` without a second read; ``online``: read from the store now), and the log
        the held-out losses and learning rates they carry. A step not there yet is read at a
        later call, and the ones after it wait for it: the latest all-reduce (t - 1) may still
        run, and read live, so may an earlier one (a loaded machine's lowest replica publishes
        late, yet the fast ones are iterations ahead). A step is skipped as failed (it had no
        update) only where none will come: a fixed c's before t - 1 (read with its reports),
        one read live before a regrouping's resume once every member of its generation joined
        (:meth:`regrouped`), and any at the end (``final``: after the bounded wait)."""
        k = self.next
        while k < t:
            step = self.read.pop(k, None)
            if step is None and online:
                step = self.take_live(k)
            if step is None and not (final or self.lost(k, t, online)):
                break
            if step is None and online and not final:  # (published as its member joined)
                step = self.take_live(k)
            if step is not None and step.stats is not None:  # (None: it applied nothing)
                n, sq, mean_sq, samples = step.stats
                self.noise.update(n, self.batch_size, sq, mean_sq, samples)
            self.settle_evals(k, step.evaluated if step is not None else None)
            k += 1
        self.next = k

    def take_live(self, k: int) -> P.Step | None:
        """Step k from the store if it is there (read live), its learning rate into the log."""
        if not self.c10d.check([P.step_key(k)]):
            return None
        step = P.decode_step(self.c10d.get(P.step_key(k)), slots=False)
        self.c10d.delete_key(P.step_key(k))  # (online: a fixed c's goes to the janitor)
        self.take_lr(k, step.lr)
        return step

    def lost(self, k: int, t: int, online: bool) -> bool:
        """Whether step k, not there at iteration t, never will be (see :meth:`read_through`):
        read live, one before the last regrouping's resume once every member of its generation
        has joined it (each publishes its steps before it joins; until then a slow lowest
        replica's may still come)."""
        if not online:
            return k < t - 1
        if k >= self.resumed_at:
            return False
        if self.joining is not None:
            generation, members = self.joining
            if self.c10d.add(P.joined_key(generation), 0) < members:
                return False
            self.joining = None
        return True

    def regrouped(self, resume: int, generation: int, members: int) -> None:
        """A regrouping began ``generation`` of ``members`` replicas at ``resume``: an all-reduce
        before it that has published no step once they all joined failed."""
        self.resumed_at = max(self.resumed_at, resume)
        self.joining = (generation, members)

    def settle_evals(self, k: int, evaluated: tuple[int, float] | None) -> None:
        """Step k is read (or failed): it carried the held-out loss of the due iteration
        before it, if any, summed by its all-reduce (:mod:`bdsgd.stages.engine.replica`); a due
        iteration before k whose loss no step carried (a regrouping came between) goes
        without one."""
        if evaluated is not None and evaluated[0] in self.pending_evals:
            self.log.rows["eval_loss"][self.pending_evals.pop(evaluated[0])] = evaluated[1]
        for due in [d for d in self.pending_evals if d < k]:
            del self.pending_evals[due]

    def eval_due(self, t: int) -> None:
        """Iteration t's held-out loss comes with a later step (its row is recorded next)."""
        self.pending_evals[t] = len(self.log.rows.get("iteration", []))

    def take_lr(self, t: int, lr: float | None) -> None:
        """The learning rate step t applied, as the replicas computed it: into t's log row, or
        kept for it if t is not recorded yet."""
        if t in self.pending_lrs:
            self.log.rows["lr"][self.pending_lrs.pop(t)] = lr
        else:
            self.lrs[t] = lr
        for late in [d for d in self.pending_lrs if d < t]:  # (their steps never came: failed)
            del self.pending_lrs[late]

    def lr_of(self, t: int) -> float | None:
        """The learning rate for t's row, about to be recorded: known if its step was read,
        else None until :meth:`take_lr` fills it in (and for a step that never comes)."""
        if t in self.lrs:
            return self.lrs.pop(t)
        self.pending_lrs[t] = len(self.log.rows.get("iteration", []))
        return None

    def collect_evals(self, next_iteration: int, online: bool, wait_s: float) -> None:
        """At the end: the steps not yet read, then the held-out loss due after the last
        iteration, which the lowest replica evaluates as it stops (waiting up to ``wait_s``
        in all). Read live (``online``), the last all-reduces may still run as the coordinator
        ends: their steps, which carry the learning rate of the last rows, are waited for
        first (a loaded machine published the last one after the end and left its row's
        learning rate empty); a step that never comes (a failed all-reduce) costs the wait."""
        deadline = time.monotonic() + wait_s
        if online:  # (one before a regrouping's resume that is not there failed)
            for k in range(max(self.next, self.resumed_at), next_iteration):
                P.wait_key(self.c10d, P.step_key(k), max(deadline - time.monotonic(), 0.0))
        self.read_through(next_iteration, online, final=True)
        for t, index in list(self.pending_evals.items()):
            if P.wait_key(self.c10d, P.eval_key(t), max(deadline - time.monotonic(), 0.0)):
                self.log.rows["eval_loss"][index] = float(self.c10d.get(P.eval_key(t)).decode())
            del self.pending_evals[t]
