"""What every training rank of a user's loop runs: :class:`Cutoff`, the few lines that put a
data-parallel loop's gradient all-reduce under a cutoff policy.

Each iteration a rank computes its micro-batches (:meth:`Iteration.micro_batches`); between two
of them it looks for the iteration's cut (one c10d-store check). A rank whose computation ends
before the cut takes an arrival ticket (``store.add``); a ticket below ``CLOSED`` admits its
gradient. Then every rank enters one all-reduce of (gradient sum, samples, admitted, loss): an
admitted rank contributes its whole gradient, a cut one its finished micro-batches (``salvage``,
the default; zeros without it), and the sum is divided by the contributed samples. The coordinator
(:mod:`~bdsgd.stages.loop.coordinator`, a thread beside one rank's loop) asks the policy, reads
the tickets as they come and closes the counter at the cut; no rank waits for it otherwise.

This module imports no coordinator, trace store, polars, pyarrow or rich: a rank loads them only
where it runs the coordinator.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from bdsgd.stages.errors import BdsgdError, CheckpointError, ConfigError, first_line
from bdsgd.stages.goodput import NoiseScale
from bdsgd.stages.ids import new_run_id
from bdsgd.stages.loop.config import (
    LoopConfig,
    _stragglers,
    lr_factor,
    lr_rule,
    source_of,
)
from bdsgd.stages.loop.group_exit import release_default_group
from bdsgd.stages.loop.relay import NodeCut, wants_relay
from bdsgd.stages.loop.timing import ComputeTimer
from bdsgd.stages.run_dir import check_out, clear_run, lock_run_dir
from bdsgd.stages.safe_load import load_plain, save_atomic
from bdsgd.stages.wire import keys as P
from bdsgd.stages.wire.report import WorkerReport

STATS = 7  # slots after the gradient: samples, admitted ranks, admitted loss sum, planned
# samples, ranks that asked the job to stop, admitted ranks' squared gradient norms (noise scale),
# the ranks' parameter checksums (every check_every iterations)
CHECKPOINT_VERSION = 1


@dataclass(frozen=True)
class IterationResult:
    """What one iteration's all-reduce applied, as every rank sees it."""

    iteration: int
    admitted: int  # ranks whose whole gradient was admitted (c)
    samples: float  # samples in the averaged gradient
    planned: float  # samples of every rank's whole batch
    loss: float | None  # mean training loss of the admitted ranks
    cut: bool  # this rank was cut
    stop: bool = False  # a rank asked the job to stop after this iteration (request_stop)

    @property
    def share(self) -> float:
        return self.samples / self.planned if self.planned > 0 else 1.0


class Cutoff:
    """Cutoff-controlled data parallelism for an ordinary ``torchrun`` training loop.

    Create it once per rank after ``torch.distributed.init_process_group`` and after the model
    is on its device (it broadcasts rank 0's parameters, as DDP does), in place of wrapping the
    model in DDP::

        cut = bdsgd.Cutoff(model, policy="static:3", micro_batches=4, out="run", traces="traces")
        for step in range(cut.resume(optimizer, scheduler), steps):
            with cut.iteration() as it:
                for x, y in it.micro_batches(next(batches)):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = F.cross_entropy(model(x), y)
                    it.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            cut.step(optimizer)          # optimizer.step() at the admitted samples' lr
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        cut.close()

    Options are :class:`~bdsgd.stages.loop.config.LoopConfig`'s fields.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: LoopConfig | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        **options,
    ) -> None:
        _check_arguments(model, config, optimizer)
        if config is not None and options:
            raise ConfigError("pass either a LoopConfig or keyword options, not both")
        self.cfg = cfg = config or LoopConfig(**options)
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("bdsgd.Cutoff needs torch.distributed: call init_process_group first")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cfg.coordinator_rank >= self.world:
            raise ConfigError(
                f"coordinator_rank {cfg.coordinator_rank} is not a rank of this "
                f"{self.world}-rank job"
            )
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = list(model.buffers()) if cfg.broadcast_buffers else []
        self.noise = NoiseScale()  # the gradient noise scale, from the all-reduced statistics
        self.needs_noise = cfg.lr_scaling == "adascale" or "goodput" in cfg.policy
        if not self.params:
            raise ConfigError("the model has no parameters that require a gradient")
        self.device = self.params[0].device
        self.optimizer = optimizer
        self.timer = ComputeTimer(self.device)
        self.run_dir_lock = self._own_run_dir()
        self.run_id = self._agree(cfg.run_id or new_run_id(source_of(cfg.policy)))
        self.c10d = dist.PrefixStore(f"bdsgd/{self.run_id}/", _default_store())
        self.delays, emulated = _stragglers(cfg, self.world, self.rank)
        machines = _gather(socket.gethostname())
        self.hosts = emulated or machines
        self.flat = self._flat_buffer()
        self.grad_views = self._grad_views()
        self.viewable = [self._fits(p) for p in self.params]  # (the buffer's dtype and device)
        self.t = 0
        self.last: IterationResult | None = None
        self.rule: str | None = None if cfg.lr_scaling == "auto" else cfg.lr_scaling
        self.planned_full = 0.0  # a rank's whole batch, samples (accumulate: the last seen)
        self.stop_requested = False
        self.cuts_set = 0  # iterations this rank cut as the holder of their announced ticket c
        self.measure_only = cfg.policy == "full"  # no cut ever comes: ranks never look for one
        self.coordinator = self._start_coordinator()
        relay = not self.measure_only and wants_relay(cfg.cut_relay, machines)
        self.node_cut = NodeCut(self.c10d, machines, self.rank, relay, lambda: self.t,
                                cfg.timeout_s)  # fmt: skip
        broadcast_module(model, src=0)
        dist.barrier()
        self.t0: float | None = None  # the first iteration's start: the run's clock starts there
        self.broken: str | None = None  # an iteration ended in an error: what it was (Iteration)
        self.closed = False
        self.began = False  # the first iteration began (a previous run's files are gone)

    # -- the loop -------------------------------------------------------------------------------
    def iteration(self) -> Iteration:
        """The next iteration: ``with cut.iteration() as it:`` around its micro-batches; the
        gradients are all-reduced over the admitted samples when the block ends."""
        self._usable()
        if not self.began:
            self._begin_run()
        return Iteration(self, self.t)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` with every group's learning rate scaled for the admitted share
        of the samples (``lr_scaling``), then restored, so an LR scheduler keeps its own."""
        self._usable()
        if self.rule is None:
            self.rule = lr_rule(self.cfg.lr_scaling, type(optimizer).__name__)
        factor = 1.0
        if self.last is not None and self.rule == "adascale":
            factor = self.noise.lr_factor(self.last.share * self.world, self.world)
        elif self.last is not None:
            factor = lr_factor(self.rule, self.last.share)
        saved = [group["lr"] for group in optimizer.param_groups]
        try:
            for group in optimizer.param_groups:
                group["lr"] = _scaled(group["lr"], factor)
            optimizer.step()
            applied = optimizer.param_groups[0]["lr"]
        finally:
            for group, lr in zip(optimizer.param_groups, saved, strict=True):
                group["lr"] = lr
        if self.coordinator is not None and self.last is not None:
            self.coordinator.rank_values(self.last.iteration, lr=float(applied))

    def request_stop(self) -> None:
        """Ask every rank to stop after the next all-reduce: the request travels in it, so all
        ranks see ``cut.last.stop`` after the same iteration (a preemption notice, a wall-clock
        budget, a Ctrl-C seen by one rank) and can save and close together."""
        self.stop_requested = True

    def log_eval(self, loss: float) -> None:
        """Record a held-out loss after the last iteration (rank-side; kept by the coordinator
        rank for the iteration log and the summary's ``final_loss``)."""
        if self.coordinator is not None and self.last is not None:
            self.coordinator.rank_values(self.last.iteration, eval_loss=float(loss))

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, optimizer=None, scheduler=None, path: str | os.PathLike | None = None, **extra):
        """Rank 0 writes a checkpoint (state dicts of the model, optimizer, scheduler, the next
        iteration) atomically to ``path`` (default ``<out>/checkpoint.pt``); the trace rows and
        the iteration log through the last iteration are written first, so a resumed run
        neither repeats nor misses one. Every rank calls it (it ends with a barrier)."""
        self._usable()
        target = self._checkpoint_path(path)
        if self.coordinator is not None:  # the rows are on disk before the checkpoint counts them
            self._together(lambda: self.coordinator.record(self.t))
        else:
            self._together(lambda: None)
        state = {
            "version": CHECKPOINT_VERSION,
            "run_id": self.run_id,
            "world_size": self.world,
            "next_iteration": self.t,
            "model": self.model.state_dict(),
            "optimizer": None if optimizer is None else optimizer.state_dict(),
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "extra": extra,
        }
        self._together(lambda: save_atomic(state, target) if self.rank == 0 else None)
        return target

    def resume(self, optimizer=None, scheduler=None, path: str | os.PathLike | None = None) -> int:
        """Load the checkpoint at ``path`` (default ``<out>/checkpoint.pt``) if it exists, on
        every rank (``weights_only``: loading runs no code); returns the iteration to continue
        from (0 without one). Every rank calls it: the ranks compare what each found, and
        unless all found the same (each its own file system) every rank raises the same
        :class:`CheckpointError`, before any loads."""
        self._usable()
        target = self._checkpoint_path(path)
        state, found = self._read_checkpoint(target)
        agree_on_checkpoint(_gather(found))
        if state is None:
            return 0
        self.model.load_state_dict(state["model"])
        if optimizer is not None and state.get("optimizer") is not None:
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state.get("scheduler") is not None:
            scheduler.load_state_dict(state["scheduler"])
        self.t = int(state["next_iteration"])
        self.run_id = state["run_id"]  # every later checkpoint continues the same run
        self.began = True  # (the run directory's files are this run's)
        if self.coordinator is not None:
            self.coordinator.resumed_at(self.t, state["run_id"])
        return self.t

    def close(self) -> dict | None:
        """End the run: the coordinator writes what is left (trace rows, the run directory)
        and returns the summary on its rank (None elsewhere). Every rank calls it; a second
        call returns None. A broken Cutoff (an iteration ended in an error) writes the
        iterations before that one and leaves its run directory incomplete."""
        if self.closed:
            return None
        self.closed = True
        box: list = [None]
        try:
            if self.coordinator is not None:
                self._together(lambda: box.__setitem__(0, self._close_coordinator()))
            else:
                self._together(lambda: None)
        finally:
            self.node_cut.close()
            if self.run_dir_lock is not None:
                self.run_dir_lock.release()
            release_default_group()  # (else the group outlives destroy_process_group: group_exit)
        return box[0]

    def _close_coordinator(self) -> dict:
        summary = self.coordinator.close(self.t, broken=self.broken is not None)
        for slow in summary["slow_ranks"]:
            print(f"bdsgd: rank {slow['rank']} on {slow['host']} is persistently slow: median "
                  f"{slow['median_s'] * 1e3:.1f} ms, {slow['ratio']:.2f}x the ranks' median, "
                  f"cut in {slow['cut_share']:.0%} of iterations", file=sys.stderr)  # fmt: skip
        return summary

    def _together(self, work) -> None:
        """``work`` on this rank, then a meeting of every rank (a barrier that carries errors):
        when bdsgd's own work failed on some rank (a full disk at rank 0's checkpoint, its
        trace rows, its run directory), every rank raises the same one line naming the first
        such rank and the cause, instead of the others failing on a closed connection."""
        error = None
        try:
            work()
        except (BdsgdError, OSError) as exc:
            error = f"rank {self.rank}: {first_line(exc)}"
        errors = [None] * self.world
        dist.all_gather_object(errors, error)
        if first := next((e for e in errors if e is not None), None):
            raise BdsgdError(first)

    # -- internals ------------------------------------------------------------------------------
    def _usable(self) -> None:
        """A one-line error for a call on a closed or broken Cutoff (its ranks and coordinator
        no longer meet: the call would wait out ``timeout_s``)."""
        if self.closed:
            raise BdsgdError("this Cutoff is closed")
        if self.broken is not None:
            raise BdsgdError(f"{self.broken}: this Cutoff cannot continue; restart the job and "
                             "resume from its last checkpoint (cut.resume)")  # fmt: skip

    def _own_run_dir(self):
        """Rank 0 checks ``out`` (a new path, or a directory of a bdsgd run) and takes its lock
        before anything there is read or written; every rank raises the same one line when it
        cannot (a file, someone else's files, another run holding it)."""
        lock, error = None, None
        if self.cfg.out is not None and self.rank == 0:
            try:
                out = Path(self.cfg.out)
                check_out(out, "out=")
                lock = lock_run_dir(out)
            except ConfigError as exc:
                error = str(exc)
        error = self._agree(error)
        if error is not None:  # no close() will follow: let the script's group end cleanly
            release_default_group()
            raise ConfigError(error)
        return lock

    def _begin_run(self) -> None:
        """A run that did not resume starts afresh: rank 0 removes a previous run's files from
        ``out`` (it holds the lock) before the first iteration writes any."""
        self.began = True
        if self.cfg.out is not None and self.rank == 0:
            clear_run(Path(self.cfg.out))

    def _read_checkpoint(self, target: Path) -> tuple[dict | None, int | str | None]:
        """This rank's checkpoint at ``target`` and what it found there: the next iteration,
        None (no file) or the one-line reason it cannot be loaded."""
        if not target.exists():
            return None, None
        try:
            if not target.is_file():
                raise CheckpointError(f"{target} is not a file: resume takes a checkpoint file")
            state = load_state(target, self.world)
            return state, int(state["next_iteration"])
        except BdsgdError as exc:
            return None, first_line(exc)

    def _checkpoint_path(self, path) -> Path:
        if path is not None:
            return Path(path)
        if self.cfg.out is None:
            raise ConfigError("save/resume need a path, or out= for <out>/checkpoint.pt")
        return Path(self.cfg.out) / "checkpoint.pt"

    def _agree(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _flat_buffer(self) -> torch.Tensor:
        dtype = (
            torch.float64 if all(p.dtype == torch.float64 for p in self.params) else torch.float32
        )
        numel = sum(p.numel() for p in self.params)
        return torch.zeros(numel + STATS, dtype=dtype, device=self.device)

    def _grad_views(self) -> list[torch.Tensor]:
        """Each parameter's slice of the all-reduce buffer, shaped as the parameter and, where
        the parameter is dense (a channels_last or transposed weight too), with its strides: a
        gradient laid out otherwise breaks the layout fused optimizers rely on (as DDP's
        bucket views keep it)."""
        views, offset = [], 0
        for p in self.params:
            if _dense(p):
                start = self.flat.storage_offset() + offset
                views.append(self.flat.as_strided(p.shape, p.stride(), start))
            else:
                views.append(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def _attach_grads(self) -> None:
        """Every parameter without a gradient (``zero_grad(set_to_none=True)``) gets its zeroed
        slice of the all-reduce buffer as ``.grad``, as DDP's ``gradient_as_bucket_view``: the
        backward then accumulates into the buffer, and the all-reduce needs no copy in or out
        (for a GPT-2 of 52 tensors, 104 copies and two passes over the gradient a step). A
        gradient the user set otherwise is copied in and out as before."""
        fresh = [i for i, (p, ok) in enumerate(zip(self.params, self.viewable, strict=True))
                 if ok and p.grad is None]  # fmt: skip
        if len(fresh) == len(self.params):
            self.flat[: self.flat.numel() - STATS].zero_()  # (one pass, not one per tensor)
        else:
            for i in fresh:
                self.grad_views[i].zero_()
        for i in fresh:
            self.params[i].grad = self.grad_views[i]

    def _fits(self, p: torch.Tensor) -> bool:
        """Whether the buffer can hold ``p``'s gradient as ``.grad`` (same dtype and device)."""
        return p.dtype == self.flat.dtype and p.device == self.flat.device and _dense(p)

    def _start_coordinator(self):
        """The coordinator thread on ``coordinator_rank``; a policy that cannot be built is
        the same one-line error on every rank."""
        coordinator, error = None, None
        if self.rank == self.cfg.coordinator_rank:
            try:
                from bdsgd.stages.loop.coordinator import LoopCoordinator

                coordinator = LoopCoordinator(self.cfg, self.c10d, self.world, self.hosts,
                                              self.run_id, str(self.device.type))  # fmt: skip
            except BdsgdError as exc:
                error = str(exc)
        box = [error]
        dist.broadcast_object_list(box, src=self.cfg.coordinator_rank)
        if box[0] is not None:
            raise ConfigError(box[0])
        return coordinator

    def _all_reduce(self, it: Iteration, admitted: bool) -> IterationResult:
        """One all-reduce of the gradient sum and the statistics; ``.grad`` of every
        parameter becomes the average over the admitted samples."""
        flat, numel = self.flat, self.flat.numel() - STATS
        contributes = admitted or (self.cfg.salvage and it.samples > 0)
        if not contributes:
            flat[:numel].zero_()
        else:
            for p, view in zip(self.params, self.grad_views, strict=True):
                if p.grad is None:
                    view.zero_()
                elif not (p.grad is view or _is_view(p.grad, view)):  # the user's: copied in
                    view.copy_(p.grad)
        samples = it.samples if contributes else 0.0
        own_sq = mean_sq_norm(flat[:numel], it.samples) if admitted and self.needs_noise else 0.0
        checking = self.cfg.check_every > 0 and it.t % self.cfg.check_every == 0
        checksum = parameter_checksum(self.params, self.world) if checking else 0.0
        flat[numel:] = torch.tensor(
            [
                samples,
                float(admitted),
                it.loss_mean() * admitted,
                it.planned(),
                float(self.stop_requested),
                own_sq,
                checksum,
            ],  # fmt: skip
            dtype=flat.dtype,
        )
        dist.all_reduce(flat)
        if self.buffers:  # (DDP's broadcast_buffers: every rank takes rank 0's running stats)
            broadcast_buffers(self.buffers)
        stats = flat[numel:].tolist()
        if checking and stats[6] != checksum * self.world:
            raise BdsgdError(f"the ranks' parameters differ before iteration {it.t} (their "
                             "checksums disagree): a rank stepped apart; resume every rank from "
                             "the last checkpoint")  # fmt: skip
        total = stats[0]
        if total > 0:
            flat[:numel].div_(total)
        self._observe_noise(stats, numel)
        self._write_back(flat)
        loss = stats[2] / stats[1] if stats[1] > 0 else None
        return IterationResult(it.t, int(round(stats[1])), total, stats[3], loss, not admitted,
                               stop=stats[4] > 0)  # fmt: skip

    def _observe_noise(self, stats: list[float], numel: int) -> None:
        """The gradient noise scale from the admitted ranks' squared norms and the averaged
        gradient's (:class:`~bdsgd.stages.goodput.NoiseScale`): every rank reads the same
        all-reduced values, so every rank holds the same estimate (AdaScale's learning rate);
        the coordinator's rank hands it to the policy and the log."""
        if not self.needs_noise:
            return
        batch = stats[3] / self.world
        mean_sq = float(self.flat[:numel].double().pow(2).sum()) if stats[0] > 0 else 0.0
        self.noise.update(int(round(stats[1])), max(int(round(batch)), 1), stats[5], mean_sq,
                          mean_samples=int(round(stats[0])))  # fmt: skip
        if self.coordinator is not None:
            self.coordinator.noise(
                self.t,
                self.noise.value,
                batch,
                self.noise.gain(stats[0] / batch) if batch > 0 else None,
            )

    def _write_back(self, flat: torch.Tensor) -> None:
        """Every ``.grad`` the average: a view of the buffer already is; one the user set gets
        it copied; a missing one becomes the buffer's view (its own dtype's copy if the
        parameter's dtype is not the buffer's)."""
        for p, view, ok in zip(self.params, self.grad_views, self.viewable, strict=True):
            if p.grad is view or (p.grad is not None and _is_view(p.grad, view)):
                continue  # (``is``: autograd keeps the tensor it was given, a cheap first test)
            if p.grad is None and ok:
                p.grad = view
            elif p.grad is None or p.grad.dtype != p.dtype or p.grad.shape != p.shape:
                p.grad = view.to(device=p.device, dtype=p.dtype, copy=True)
            else:
                p.grad.copy_(view)


class Iteration:
    """One iteration of a rank: its micro-batches, stopping at a cut, then the all-reduce."""

    def __init__(self, cut: Cutoff, t: int) -> None:
        self.cut, self.t = cut, t
        self.samples = 0.0  # samples of the finished micro-batches
        self.loss_sum: torch.Tensor | float = 0.0  # of the micro-batches' mean losses
        self.losses = 0
        self.current = 0  # samples of the micro-batch being computed
        self.backwards = 0
        self.planned_now = 0.0  # split(): this rank's whole batch
        self.seen_cut = False
        self.delay_s = cut.delays.at(t) if cut.delays is not None else 0.0
        self.result: IterationResult | None = None

    def __enter__(self) -> Iteration:
        cut = self.cut
        self.began = time.perf_counter()
        if cut.t0 is None:  # (not at construction: a script builds its optimizer, data, ... then)
            cut.t0 = self.began
            if cut.coordinator is not None:
                cut.coordinator.start(cut.t0)
        cut._attach_grads()
        cut.timer.start()
        if cut.coordinator is not None:
            cut.coordinator.begin(self.t, self.began)
        return self

    def __exit__(self, kind, exc, tb) -> None:
        # an error in the block (the user's: it goes on as it would without bdsgd) or as it ends
        # (bdsgd's own, a micro-batch without it.backward): the ranks skipped this iteration's
        # all-reduce, and its coordinator waits for them, so the Cutoff cannot go on
        if kind is not None:
            self._break(kind)
            return
        try:
            self._end()
        except BaseException as error:
            self._break(type(error))
            raise

    def _break(self, kind: type[BaseException]) -> None:
        self.cut.broken = f"iteration {self.t} ended in {kind.__name__}"

    def _end(self) -> None:
        """The iteration's all-reduce over the admitted samples, and its report."""
        cut = self.cut
        if self.current:  # the loop over micro-batches was left with a break
            self._finish_micro_batch()
        runtime = cut.timer.stop()
        admitted = not self.seen_cut and self._take_ticket(runtime)
        self.result = cut._all_reduce(self, admitted)
        cut.last, cut.t = self.result, self.t + 1
        if cut.coordinator is not None:
            cut.coordinator.rank_values(
                self.t,
                end=time.perf_counter(),
                loss=self.result.loss,
                samples=self.result.samples,
            )

    # -- micro-batches --------------------------------------------------------------------------
    def micro_batches(self, batch, parts: int | None = None) -> Iterator:
        """``batch`` (a tensor, or a tuple/list/dict of tensors sharing their first dimension)
        in ``parts`` micro-batches (default ``micro_batches``), until the iteration is cut."""
        parts = parts or self.cut.cfg.micro_batches
        pieces = split_batch(batch, parts)
        self.planned_now = float(sum(batch_size(p) for p in pieces))
        return self.accumulate(pieces, _planned=True)

    def accumulate(self, micro_batches: Iterable, _planned: bool = False) -> Iterator:
        """Any iterable of micro-batches (gradient accumulation over a ``DataLoader``), until the
        iteration is cut."""
        count = len(micro_batches) if hasattr(micro_batches, "__len__") else None
        for i, mb in enumerate(micro_batches):
            if i > 0 and self._is_cut():
                return
            self.current = batch_size(mb)
            yield mb
            self._finish_micro_batch()
            self._device_time(count or self.cut.cfg.micro_batches)
        if not _planned:
            self.cut.planned_full = self.samples

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a micro-batch's mean loss, weighted by its samples: the all-reduce
        then divides by the samples admitted."""
        if self.current == 0:
            raise BdsgdError("it.backward(loss) outside a micro-batch of it.micro_batches()")
        (loss * self.current).backward()
        self.loss_sum = self.loss_sum + loss.detach().float()  # read once, at the end
        self.losses += 1
        self.backwards += 1

    def loss_mean(self) -> float:
        if not self.losses:
            return 0.0
        mean = float(self.loss_sum) / self.losses
        return mean if math.isfinite(mean) else 0.0

    def planned(self) -> float:
        if self.planned_now:
            return self.planned_now
        return max(self.cut.planned_full, self.samples)

    # -- the cut --------------------------------------------------------------------------------
    def _finish_micro_batch(self) -> None:
        if self.backwards == 0:
            raise BdsgdError("a micro-batch ended without it.backward(loss): bdsgd scales and "
                             "accumulates the gradient there")  # fmt: skip
        self.samples += self.current
        self.current, self.backwards = 0, 0
        self.cut.timer.mark()

    def _is_cut(self) -> bool:
        if self.cut.measure_only:
            return False  # (full cuts nothing: no store call between micro-batches)
        if not self.seen_cut:
            self.seen_cut = self.cut.node_cut.view.check([P.cut_key(self.t)])
        return self.seen_cut

    def _device_time(self, parts: int) -> None:
        """This micro-batch's share of the injected delay (``--stragglers``): emulated device
        time, which a cut does not end. A real rank finishes the micro-batch it is in before
        it sees the cut, and an emulated one that stopped at once would count a micro-batch
        whose time it never spent (a cut then looked free)."""
        if self.delay_s > 0:
            time.sleep(self.delay_s / max(parts, 1))

    def _take_ticket(self, runtime: float) -> bool:
        """Arrive: a ticket taken before the counter was closed admits this rank's gradient;
        the report goes under the ticket for the coordinator either way (a rank that finished
        its batch after the close has an exact run-time). The holder of ticket c of an
        iteration whose c was announced cuts it first (:func:`~bdsgd.stages.wire.keys.cut_at_limit`)."""
        cut = self.cut
        ticket = P.decode_ticket(cut.c10d.add(P.ticket_key(self.t), 1))
        if not ticket.closed and ticket.number == ticket.limit:
            P.cut_at_limit(cut.c10d, self.t, ticket.limit)
            cut.cuts_set += 1
        # a rank too late for the cut but with its whole batch done reports too: its run-time
        # is known, not censored (the coordinator reads it after the all-reduce)
        report = WorkerReport(cut.rank, self.t, self.began - cut.t0, runtime,
                              self.loss_mean(), self.delay_s)  # fmt: skip
        cut.c10d.set(P.arrival_key(self.t, ticket.number), report.encode())
        return not ticket.closed


# -- helpers ------------------------------------------------------------------------------------
def _dense(p: torch.Tensor) -> bool:
    """Whether ``p``'s elements fill ``p.numel()`` places of its storage, each once, in some
    order of its dimensions (contiguous, channels_last, transposed, ...)."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(p.shape, p.stride(), strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _is_view(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``grad`` is the buffer slice ``view`` itself (not a copy of it)."""
    return (grad.data_ptr() == view.data_ptr() and grad.shape == view.shape
            and grad.stride() == view.stride())  # fmt: skip


def split_batch(batch, parts: int) -> list:
    """``batch`` cut along its first dimension into at most ``parts`` micro-batches."""
    n = batch_size(batch)
    if n == 0:
        raise ConfigError("an empty batch cannot be split into micro-batches")
    parts = min(parts, n)
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [_slice(batch, a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _slice(batch, a: int, b: int):
    if isinstance(batch, torch.Tensor):
        return batch[a:b]
    if isinstance(batch, dict):
        return {k: _slice(v, a, b) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice(v, a, b) for v in batch)
    raise ConfigError(f"cannot split a batch of type {type(batch).__name__}: pass tensors")


def batch_size(batch) -> int:
    """Samples in a micro-batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)) and batch:
        return batch_size(batch[0])
    raise ConfigError(f"cannot count the samples of a {type(batch).__name__}: pass tensors")


@torch.no_grad()
def parameter_checksum(params: list[torch.Tensor], world: int) -> float:
    """Low bits of the float64 sum of every parameter, as a float: identical parameters give
    the same value on every rank, and their sum over ``world`` ranks is exact even in float32
    (below 2^24)."""
    total = sum(float(p.detach().double().sum()) for p in params)
    bits = max(4, 23 - world.bit_length())
    return float(struct.unpack("<q", struct.pack("<d", total))[0] & ((1 << bits) - 1))


def mean_sq_norm(summed: torch.Tensor, samples: float) -> float:
    """The squared norm of a rank's mean gradient, from its gradient summed over ``samples``."""
    if samples <= 0:
        return 0.0
    return float(summed.double().pow(2).sum()) / (samples * samples)


def broadcast_buffers(buffers: list[torch.Tensor], src: int = 0) -> None:
    """Every rank's ``buffers`` take rank ``src``'s values: one broadcast per dtype and device,
    of the buffers flattened together."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for buf in buffers:
        groups.setdefault((buf.dtype, buf.device), []).append(buf)
    for group in groups.values():
        flat = torch.cat([b.detach().reshape(-1) for b in group])
        dist.broadcast(flat, src=src)
        offset = 0
        for buf in group:
            buf.data.copy_(flat[offset : offset + buf.numel()].view_as(buf))
            offset += buf.numel()


def broadcast_module(model: torch.nn.Module, src: int = 0) -> None:
    """Every parameter and buffer of ``model`` takes rank ``src``'s values (as DDP does)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=src)


def load_state(path: Path, world: int | None = None) -> dict:
    """A checkpoint written by :meth:`Cutoff.save` (``weights_only``: loading runs no code);
    with ``world``, one of a job of that many ranks."""
    state = load_plain(path, "bdsgd loop checkpoint")
    if state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} is not a bdsgd loop checkpoint (version 1)")
    if world is not None and state.get("world_size") != world:
        raise CheckpointError(f"{path} was written by a {state.get('world_size')}-rank job, "
                              f"this one has {world}")  # fmt: skip
    return state


def agree_on_checkpoint(found: list) -> None:
    """Raise on every rank unless every rank found the same checkpoint (``found``: each rank's
    next iteration, None for no file, or why its file cannot be loaded)."""
    if all(f == found[0] for f in found):
        if isinstance(found[0], str):
            raise CheckpointError(found[0])
        return
    by_value: dict = {}
    for rank, value in enumerate(found):
        by_value.setdefault(value, []).append(rank)
    each = "; ".join(f"{_ranks(ranks)}: {_found(value)}" for value, ranks in by_value.items())
    raise CheckpointError(f"resume found different checkpoints on the ranks ({each}): every rank "
                          "must read the same checkpoint file (a shared filesystem)")  # fmt: skip


def _found(value) -> str:
    return "none" if value is None else f"iteration {value}" if isinstance(value, int) else value


def _ranks(ranks: list[int], shown: int = 8) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    more = f", ... ({len(ranks)} ranks)" if len(ranks) > shown else ""
    return "ranks " + ", ".join(map(str, ranks[:shown])) + more


def _check_arguments(model, config, optimizer) -> None:
    """One-line errors for arguments of the wrong kind (``Cutoff(optimizer)``, a policy
    name given as the config)."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"Cutoff's first argument must be the model (a torch.nn.Module), got "
                          f"{type(model).__name__}")  # fmt: skip
    if config is not None and not isinstance(config, LoopConfig):
        raise ConfigError(f"config must be a bdsgd.LoopConfig or None, got {type(config).__name__}"
                          " (options go as keywords: Cutoff(model, policy=...))")  # fmt: skip
    if optimizer is not None and not _optimizer_like(optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer or None, got "
                          f"{type(optimizer).__name__}")  # fmt: skip


def _optimizer_like(optimizer) -> bool:
    """A torch optimizer, or a wrapper that acts as one (its ``param_groups`` and ``step``): the
    lr scaling needs no more."""
    return hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))


def _scaled(lr, factor: float):
    return lr * factor if isinstance(lr, float | int) else lr.mul(factor)


def _default_store() -> dist.Store:
    """The process group's own c10d store (torchrun's, or the one init_process_group made):
    nothing large passes through it."""
    return dist.distributed_c10d._get_default_store()


def _gather(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
