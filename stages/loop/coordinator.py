"""The coordinator of a user's training loop: a thread beside one rank's loop (never a rank of
its own), so every GPU trains.

Per iteration t it asks the policy for c when the rank it lives with begins t
(:meth:`LoopCoordinator.begin`), reads the arrival tickets' reports in ticket order
(``a/<t>/<k>``; after each, every report already taken in one ``multi_get``) and feeds them to the :class:`~bdsgd.stages.policies.driver.IterationDriver`
(an online policy revises c at each arrival, and at ticks while none comes). At the cut it closes
the ticket counter (``n/<t>`` + ``CLOSED``: the ranks that took a ticket before are admitted,
every later one is cut) and sets ``cut/<t>``, which the ranks still computing see at their next
micro-batch. The coordinator announces the policy's c in the ticket counter
(:func:`~bdsgd.stages.wire.keys.announce_limit`) and the rank that takes ticket c sets the
cut itself, one round trip after its ticket, without waiting for the coordinator to read c
reports (at 1,024 ranks that read left the cut ~10 ms behind the c-th arrival,
``benchmarks/control_plane.py``); the coordinator's own close then changes nothing. An online
policy's c stands until it is revised: after each revision the coordinator moves the announced c
(:func:`~bdsgd.stages.wire.keys.move_limit`), so its cut too is set by the rank that takes
the ticket of the c standing then, which the policy chose from the reports read before it (a
revision lowered below the tickets already taken is cut by the coordinator at its next read). Arrivals exactly and the rest censored at the cut go to the policy, the trace rows
(schema v1) and the iteration log, which the run directory keeps for ``bdsgd report``.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
from bdsgd.schemas.run_dir import (
    ITERATIONS,
    iterations_table,
    read_run_dir,
    segment_paths,
    write_run_dir,
    write_segment,
)
from bdsgd.stages.errors import BdsgdError, first_line
from bdsgd.stages.loop.config import MAX_ITERATIONS, LoopConfig, source_of
from bdsgd.stages.loop.relay import own_connection
from bdsgd.stages.policies.base import observe_run
from bdsgd.stages.policies.driver import IterationDriver
from bdsgd.stages.policies.registry import make_policy
from bdsgd.stages.policies.selfcheck import self_check_report
from bdsgd.stages.store import TraceStore, TraceWriter
from bdsgd.stages.summary import run_summary
from bdsgd.stages.wire import keys as P
from bdsgd.stages.wire.janitor import KeyJanitor
from bdsgd.stages.wire.report import WorkerReport, trace_columns

FLUSH = ("flush",)  # put by record(): the thread ends its pending iteration, begins none
IDLE_WAIT_S = 5.0  # longest single store wait for an arrival when no tick is due
MIN_WAIT_S = 0.001  # shortest store wait before a due tick
PREDICTED = ("pred_q10", "pred_q50", "pred_q90")
MIN_RANKS_TO_NAME = 3  # with fewer ranks, "slower than the median" says nothing
SLOW_FACTOR = 1.2  # a rank whose median run-time is this much above the cluster's is named
CUT_MARGIN = 0.25  # ... or one cut this much more often than the typical rank


def cutoff_of(outcome, world: int) -> int | None:
    """The trace rows' ``cutoff``: the c the policy used (its choice, or the revision that cut),
    None when it awaited every gradient."""
    if outcome.chosen_c < world:
        return outcome.chosen_c
    return outcome.c if outcome.c < world else None


class LoopCoordinator:
    """Policy, tickets and cut of a loop's iterations, run on a daemon thread."""

    def __init__(self, cfg: LoopConfig, c10d, world: int, hosts: list[str], run_id: str,
                 device: str) -> None:  # fmt: skip
        # a connection of its own: a TCPStore client serves one blocking call at a time, and the
        # rank's loop on the other thread takes its tickets through the same store
        if world > P.MAX_RANKS:
            raise BdsgdError(f"a training loop of {world} ranks: bdsgd's ticket counter holds "
                             f"at most {P.MAX_RANKS}")  # fmt: skip
        self.cfg, self.c10d, self.world = cfg, own_connection(c10d), world
        self.hosts, self.run_id, self.device = list(hosts), run_id, device
        self.policy = make_policy(cfg.policy, world, cfg.checkpoint, self.hosts, seed=cfg.seed,
                                  overhead_s=cfg.overhead_s or 0.0, explore=cfg.explore)  # fmt: skip
        if self.policy.mode != "sync" or cfg.policy == "oracle":
            raise BdsgdError(f"policy {cfg.policy!r} cannot cut a training loop's iterations")
        self.policy.salvage_parts = cfg.micro_batches if cfg.salvage else 0
        self.driver = IterationDriver(self.policy, world)
        self.standing = P.StandingC(world)  # the c announced in the iteration's ticket counter
        self.writer = TraceWriter(TraceStore(cfg.traces)) if cfg.traces else None
        self.begins: queue.Queue = queue.Queue()
        self.pending: tuple | None = None  # the iteration cut last, ended after its all-reduce
        self.passed = threading.Event()  # the rank passed an all-reduce (rank_values' end)
        self.coordinated: dict[int, dict] = {}  # t -> what the coordinator saw of iteration t
        self.ranked: dict[int, dict] = defaultdict(dict)  # t -> what the rank reported of t
        self.runtimes: list[np.ndarray] = []  # per-iteration run-times, for the slow-rank note
        self.censored: list[np.ndarray] = []
        self.log: dict[str, list] = {}
        self.logged_through = -1  # the last iteration in the log
        self.log_written = 0  # rows of the log in the run directory (iterations or segments)
        self.skip_through = -1  # a resumed run: rows of iterations up to here are on disk
        self.rows_added = 0
        self.delay_columns: dict = {}  # rank -> its injected delays (cut ranks' rows)
        self.straggler_model = None  # --stragglers, parsed at the first cut rank
        self.noise_now: tuple | None = None  # the last noise scale and per-rank batch
        self.previous: tuple[float, float] | None = None  # the last iteration's start and cut
        self.overhead: float | None = None  # the measured fixed cost of an iteration, seconds
        self.replayed = 0  # a resumed run: iterations of its traces fed to the policy
        self.error: BaseException | None = None
        self.abandoned = False  # close() of a broken loop: the iteration watched never ends
        self.lock = threading.Lock()
        self.janitor = KeyJanitor(self.c10d)
        self.thread = threading.Thread(target=self._run, name="bdsgd-coordinator", daemon=True)
        self.t0 = 0.0
        self.wall_offset = 0.0  # a resumed run: the seconds it ran before (its clock goes on)

    # -- called by the rank's loop --------------------------------------------------------------
    def start(self, t0: float) -> None:
        self.t0 = t0
        self.thread.start()

    def begin(self, t: int, began: float) -> None:
        self._check()
        self.ranked[t]["began"] = began
        self.begins.put((t, began))

    def rank_values(self, t: int, **values) -> None:
        self.ranked[t].update(values)
        if "end" in values:
            self.passed.set()

    def noise(self, t: int, value: float | None, batch: float, gain: float | None) -> None:
        """Iteration t's gradient noise scale: logged with it, and the policy's from the next
        decision on (the ``:goodput`` policies weigh c by its gain)."""
        self.ranked[t].update(noise_scale=_float(value), gain=gain)
        self.noise_now = (value, max(int(round(batch)), 1))

    def resumed_at(self, t: int, run_id: str) -> None:
        """A resumed run continues ``run_id`` at iteration t: the log keeps the run directory's
        rows before t, and the trace rows of iterations already on disk (written after the
        checkpoint, before the run stopped) are not written again."""
        self.run_id = run_id
        self.log = earlier_log(self.cfg.out, t)
        self.log_written = len(self.log.get("iteration", []))
        self.wall_offset = float(self.log["wall_s"][-1]) if self.log.get("wall_s") else 0.0
        self.logged_through = t - 1
        self.skip_through = last_iteration_on_disk(self.cfg.traces, run_id)
        self.replayed = replay_policy(self.policy, self.cfg.traces, run_id, t)

    def elapsed(self) -> float:
        """Seconds the run has trained, a resumed run's earlier ones included."""
        return time.perf_counter() - self.t0 + self.wall_offset

    def record(self, through: int) -> None:
        """Write the trace rows of every iteration coordinated so far and wait until they are
        on disk; the iteration log is kept for the run directory (bounded waits). Called by
        the rank after the all-reduce of iteration ``through - 1``."""
        if self.thread.is_alive():
            self.begins.put(FLUSH)  # (the thread ends the iteration cut last)
        self._drain(through)
        with self.lock:
            self._log_through(through - 1)
        if self.writer is not None:
            self.writer.flush()
            deadline = time.monotonic() + self.cfg.timeout_s
            while self.writer.rows_written < self.rows_added and time.monotonic() < deadline:
                self._check_writer()
                time.sleep(0.005)
            self._check_writer()
        if self.cfg.out is not None:
            self._write_run_dir(through, final=False)

    def close(self, through: int, broken: bool = False) -> dict:
        """Write what is left and end the thread. ``broken``: the iteration ``through`` began
        but its ranks never arrive; the thread leaves it at its next look (unwritten) and the
        run directory stays incomplete."""
        self.abandoned = broken
        self.record(through)
        self.begins.put(None)
        if self.thread.ident is not None:  # (started: the run had an iteration)
            self.thread.join(self.cfg.timeout_s)
        self.janitor.close()
        if self.writer is not None:
            self.writer.close(self.cfg.timeout_s)
        summary = self.summary()
        if self.cfg.out is not None:
            self._write_run_dir(through, final=not broken)
        return summary

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (item := self.begins.get()) is not None:
                self._end_pending()  # (the rank began again: it passed the last all-reduce)
                if item is not FLUSH:
                    self._iteration(*item)
            self._end_pending()
        except BaseException as exc:  # reported to the rank's loop at its next begin
            self.error = exc

    def _iteration(self, t: int, began: float) -> None:
        self._measure_overhead(began)
        if self.noise_now is not None:
            self.policy.set_noise_scale(*self.noise_now)
        self.driver.begin(np.ones(self.world, dtype=bool))
        self.standing.begin()
        self._stand(t)  # the rank holding ticket c cuts
        seen = self._watch(t, began)
        if self.abandoned:
            return
        admitted = self._cut(t)
        reports = seen + self._reports(t, len(seen) + 1, admitted)
        for rep in reports[len(seen) :]:  # (after the cut: admitted, nothing left to revise)
            self.driver.arrive(rep.worker, rep.runtime_s, revise=False)
        self.pending = (t, began, reports, admitted)
        if self._passed(t):  # (else at the rank's next begin, or at a record)
            self._end_pending()

    def _passed(self, t: int) -> bool:
        """Wait (bounded) until the rank this thread lives with passed iteration t's all-reduce
        (its ``end``): the policy then learns while the rank steps its optimizer."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while not self.abandoned and time.monotonic() < deadline:
            if "end" in self.ranked.get(t, {}):
                return True
            self.passed.wait(0.05)
            self.passed.clear()
        return False

    def _end_pending(self) -> None:
        """End the iteration cut last, once the rank this thread lives with passed its
        all-reduce (every rank reached it): the ranks that finished their whole batch after the
        cut have set their reports by then (their run-times are exact, not censored); then the
        policy, the trace rows and the log see the iteration."""
        if self.pending is None:
            return
        t, began, reports, admitted = self.pending
        self.pending = None
        late = [] if self.abandoned else self._late_reports(t, admitted)
        for rep in late:
            self.driver.arrive_late(rep.worker, rep.runtime_s)
        outcome = self.driver.end()
        self.previous = (began, outcome.cut_s)
        self._observed(t, began, outcome, reports + late, admitted)
        # deleted long after, from the janitor's thread: nothing in this loop per rank
        self.janitor.retire([P.ticket_key(t), P.cut_key(t), P.closed_key(t)]
                            + [P.arrival_key(t, k)
                               for k in range(1, admitted + len(late) + 1)])  # fmt: skip

    def _late_reports(self, t: int, admitted: int) -> list[WorkerReport]:
        """The reports of iteration t's tickets taken after its close (each a rank that
        finished its batch too late for the cut), read after every rank passed the
        all-reduce, which each entered after setting its report."""
        taken = min(P.tickets_taken(self.c10d, t), self.world)
        return self._reports(t, admitted + 1, taken)

    def _measure_overhead(self, began: float) -> None:
        """The fixed cost of an iteration (its time beyond the c-th arrival: the all-reduce,
        the step, the next batch), smoothed and fed to the policy, unless ``overhead_s`` fixes
        it."""
        if self.cfg.overhead_s is not None or self.previous is None:
            return
        before, cut_s = self.previous
        if cut_s > 0:
            spent = max(began - before - cut_s, 0.0)
            self.overhead = spent if self.overhead is None else 0.9 * self.overhead + 0.1 * spent
            self.policy.overhead_s = self.overhead

    def _stand(self, t: int) -> bool:
        """Announce the driver's c in iteration t's ticket counter, or move it there after an
        online policy's revision (:func:`~bdsgd.stages.wire.keys.move_limit`): the rank
        whose ticket is the c standing when it takes it cuts, without waiting for this thread to
        read the reports before it. A c of every rank is no cut: nothing stands. Whether the
        counter was closed when moved (the holder of a c that stood before cut)."""
        return self.standing.move(self.c10d, t, self.driver.target)

    def _cut(self, t: int) -> int:
        """Close iteration t's counter and set its cut (the number of tickets admitted), unless
        the holder of ticket c closed it first: then it says how many were admitted (tickets
        taken since count in the counter, not in the all-reduce)."""
        admitted, first = P.close_tickets(self.c10d, t)
        if first:
            self.c10d.set(P.cut_key(t), str(admitted))
            return admitted
        return self._counted(t, P.closed_count(self.c10d, t, self.cfg.timeout_s))

    def _counted(self, t: int, count: int | None) -> int:
        """A count of iteration t's tickets that may wait on the rank that closed it."""
        if count is None:
            raise BdsgdError(f"the rank that closed iteration {t} gave no count within "
                             f"{self.cfg.timeout_s:g} s")  # fmt: skip
        return count

    def _watch(self, t: int, began: float) -> list[WorkerReport]:
        """Take arrivals in ticket order until the policy cuts (or every rank arrived). A wait
        ends at the next arrival or at the online policy's next tick, whichever comes first."""
        seen: list[WorkerReport] = []
        deadline = time.monotonic() + self.cfg.timeout_s
        while (
            not self.abandoned
            and len(seen) < self.world
            and (left := deadline - time.monotonic()) > 0
        ):
            key = P.arrival_key(t, len(seen) + 1)
            if P.wait_key(self.c10d, key, self._wait_s(began, left)):
                first, (taken, closed) = len(seen) + 1, self._taken(t)
                if self._hand_over(seen, self._reports(t, first, taken)) or closed:
                    return seen  # (closed: the holder of a c that stood then cut; all read)
                if self.standing.held_cut(self.c10d, t, first, taken, self.cfg.timeout_s):
                    return seen  # (the rest admitted are read after the cut)
            elif self.driver.wait(time.perf_counter() - began):
                return seen
            if self._stand(t):  # an online policy's revised c
                return seen
        return seen

    def _taken(self, t: int) -> tuple[int, bool]:
        """How many tickets of iteration t are taken and admitted (at most one per rank), and
        whether the holder of the standing c closed the counter (no more will be)."""
        admitted, closed = P.tickets_admitted(self.c10d, t, self.cfg.timeout_s)
        return min(self._counted(t, admitted), self.world), closed

    def _hand_over(self, seen: list[WorkerReport], reports: list[WorkerReport]) -> bool:
        """The reports read together, in ticket order, to ``seen`` and the driver (one revision
        of an online policy, at the last); whether the policy cuts there."""
        seen.extend(reports)
        return self.driver.arrive_all([(rep.worker, rep.runtime_s) for rep in reports])

    def _wait_s(self, began: float, left: float) -> float:
        """Until the driver's next tick (an online policy asked again while nothing arrives),
        else as long as the timeout allows."""
        tick = self.driver.next_tick
        if tick is None:
            return min(left, IDLE_WAIT_S)
        return min(left, max(tick - (time.perf_counter() - began), MIN_WAIT_S))

    def _reports(self, t: int, first: int, last: int) -> list[WorkerReport]:
        """The reports of tickets ``first..last``, taken already (each holder sets its report
        right after its ticket), in one round trip: at 1,024 ranks, reading them one at a time
        left the coordinator 100 ms and more behind the c-th arrival
        (``benchmarks/control_plane.py``)."""
        if last < first:
            return []
        keys = [P.arrival_key(t, k) for k in range(first, last + 1)]
        return [WorkerReport.decode(blob) for blob in self.c10d.multi_get(keys)]

    def _observed(self, t: int, began: float, outcome, reports: list[WorkerReport],
                  c: int) -> None:  # fmt: skip
        predicted = self.policy.describe()
        with self.lock:
            self.coordinated[t] = dict(
                c=c, workers=self.world, decision_ms=outcome.decision_ms,
                **{k: _float(predicted.get(k)) for k in PREDICTED}, peer=predicted.get("peer"),
            )  # fmt: skip
        self.runtimes.append(outcome.runtimes.copy())
        self.censored.append(outcome.censored.copy())
        if self.writer is not None and t > self.skip_through:
            self._add_rows(t, began, outcome, reports, cutoff_of(outcome, self.world))

    def _add_rows(self, t, began, outcome, reports, cutoff) -> None:
        by_worker = {rep.worker: rep for rep in reports}
        start = max(began - self.t0, 0.0) + self.wall_offset
        rows = []
        for w in range(self.world):
            rep = by_worker.get(w)
            if rep is None:
                rep = WorkerReport(w, t, start, float(outcome.runtimes[w]), math.nan,
                                   self.injected_delay(w, t), censored=True)  # fmt: skip
            rows.append(rep)
        columns = trace_columns(rows, self.hosts, [self.device] * self.world, run_id=self.run_id,
                                world_size=self.world, cutoff=cutoff, policy=self.policy.name,
                                source=source_of(self.cfg.policy), workload=self.cfg.workload,
                                batch_size=self.cfg.batch_size)  # fmt: skip
        self.writer.add(columns)
        self.rows_added += len(rows)
        if (t + 1) % self.cfg.record_every == 0:
            self.writer.flush()

    def injected_delay(self, w: int, t: int) -> float:
        """The delay ``--stragglers`` injects into rank w's iteration t (a cut rank's row
        carries it as a finished one does)."""
        if self.cfg.stragglers == "none":
            return 0.0
        if self.straggler_model is None:  # (parsed once: a replay reads its trace store)
            from bdsgd.stages.stragglers import parse_stragglers

            self.straggler_model = parse_stragglers(self.cfg.stragglers, seed=self.cfg.seed,
                                                    time_scale=self.cfg.time_scale)  # fmt: skip
        if w not in self.delay_columns:
            self.delay_columns[w] = self.straggler_model.column(MAX_ITERATIONS, self.world, w)
        return float(self.delay_columns[w].at(t))

    # -- the log and the run directory ----------------------------------------------------------
    def _drain(self, through: int) -> None:
        """Wait (bounded) until the thread has coordinated every iteration before ``through``."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while time.monotonic() < deadline and self.error is None:
            with self.lock:
                if all(t in self.coordinated for t in range(self.logged_through + 1, through)):
                    return
            time.sleep(0.002)
        self._check()

    def _log_through(self, last: int) -> None:
        for t in range(self.logged_through + 1, last + 1):
            seen, ranked = self.coordinated.get(t), self.ranked.get(t, {})
            if seen is None or "end" not in ranked:
                break
            nxt = self.ranked.get(t + 1, {}).get("began", ranked["end"])
            row = dict(policy=self.policy.name, iteration=t, wall_s=nxt - self.t0 + self.wall_offset,
                       iteration_s=nxt - ranked["began"], loss=ranked.get("loss"),
                       eval_loss=ranked.get("eval_loss"), lr=ranked.get("lr"), staleness=0.0,
                       noise_scale=ranked.get("noise_scale"), gain=ranked.get("gain"),
                       **seen)  # fmt: skip
            for k, v in row.items():
                self.log.setdefault(k, []).append(v)
            self.logged_through = t
            self.coordinated.pop(t, None)
            self.ranked.pop(t, None)

    def summary(self) -> dict:
        """SPEC's train JSON plus the slowest ranks (measure-only runs name them)."""
        rows = self.writer.rows_written if self.writer is not None else 0
        summary = loop_summary(self.log, self.cfg, self.run_id, self.world, rows,
                               self.slow_ranks())  # fmt: skip
        if (checked := self_check_report(self.policy)) is not None:  # bdsgd: did it lean?
            summary["self_check"] = checked
        return summary

    def slow_ranks(self) -> list[dict]:
        return slow_ranks(self.runtimes, self.censored, self.hosts, self.world)

    def _write_run_dir(self, through: int, final: bool) -> None:
        out = Path(self.cfg.out)
        if not self.log.get("iteration"):
            return
        summary = {**self.summary(), "complete": final}
        try:
            if final:  # the whole log, once
                write_run_dir(out, summary, iterations_table(self.log))
            else:  # a checkpoint writes the rows since the last one
                new = {k: v[self.log_written :] for k, v in self.log.items()}
                if new.get("iteration"):
                    write_segment(out, iterations_table(new))
                write_run_dir(out, summary, None)
            self.log_written = len(self.log["iteration"])
        except OSError as exc:
            raise BdsgdError(f"cannot write run directory {out}: {first_line(exc)}") from None

    # -- errors ---------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.error is not None:
            raise BdsgdError(f"the bdsgd coordinator failed: {first_line(self.error)}")

    def _check_writer(self) -> None:
        error = getattr(self.writer, "_error", None)
        if error is not None:
            raise BdsgdError(f"writing traces failed: {first_line(error)}")


def loop_summary(log: dict, cfg: LoopConfig, run_id: str, world: int, rows: int,
                 slow: list[dict]) -> dict:  # fmt: skip
    """The run's summary (:func:`~bdsgd.stages.summary.run_summary`) with the slow ranks."""
    traces = str(Path(cfg.traces).resolve()) if cfg.traces else None
    return run_summary(log, policy=cfg.policy, run_id=run_id, traces=traces,
                       target_loss=cfg.target_loss, rows_appended=rows, engine="loop",
                       world_size=world, slow_ranks=slow)  # fmt: skip


def slow_ranks(runtimes: list[np.ndarray], censored: list[np.ndarray], hosts: list[str],
               world: int) -> list[dict]:  # fmt: skip
    """Ranks that are persistently slow, slowest first, with their host: a median run-time at
    least ``SLOW_FACTOR`` times the cluster's (censored entries count at their cut, a lower
    bound), or cut in at least half of the iterations and ``CUT_MARGIN`` more often than the
    typical rank (a policy that cuts at the first arrival cuts every rank often)."""
    if len(runtimes) == 0 or world < MIN_RANKS_TO_NAME:
        return []
    per_rank = np.median(np.stack(runtimes), axis=0)
    typical = float(np.median(per_rank))
    cut_share = np.stack(censored).mean(axis=0)
    often = (cut_share >= 0.5) & (cut_share >= float(np.median(cut_share)) + CUT_MARGIN)
    slow = (per_rank >= SLOW_FACTOR * typical) | often
    return [dict(rank=int(w), host=hosts[w], median_s=float(per_rank[w]),
                 ratio=float(per_rank[w] / typical), cut_share=float(cut_share[w]))
            for w in np.argsort(-per_rank) if slow[w]]  # fmt: skip


def earlier_log(out: str | None, before: int) -> dict[str, list]:
    """The iteration log of a run directory's rows before iteration ``before`` (empty without
    one)."""
    if out is None or not ((Path(out) / ITERATIONS).is_file() or segment_paths(Path(out))):
        return {}
    _, table = read_run_dir(Path(out))
    rows = table.filter(pc.less(table["iteration"], before)).to_pydict()
    return {k: v for k, v in rows.items() if k in LOG_COLUMNS}


LOG_COLUMNS = ("policy", "iteration", "wall_s", "iteration_s", "loss", "eval_loss", "lr",
               "staleness", "c", "workers", "decision_ms", *PREDICTED, "peer", "noise_scale",
               "gain")  # fmt: skip


def last_iteration_on_disk(traces: str | None, run_id: str) -> int:
    """The last iteration of ``run_id`` in the trace store (-1: none)."""
    if traces is None or not TraceStore(traces).files():
        return -1
    rows = TraceStore(traces).read()
    mine = rows.filter(rows["run_id"] == run_id)
    return int(mine["iteration"].max()) if mine.height else -1


def replay_policy(policy, traces: str | None, run_id: str, before: int) -> int:
    """A resumed run's policy learns what the run observed before iteration ``before`` (its
    rows in the trace store), as an uninterrupted one would have; returns how many
    iterations."""
    if traces is None:
        return 0
    run = TraceStore(traces).run_matrix(run_id, missing_ok=True)
    return 0 if run is None else observe_run(policy, run, before)


def _float(value) -> float | None:
    return None if value is None else float(value)
