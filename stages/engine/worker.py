"""What every parameter-server worker process does: set up its workload, data stream and column
of injected delays, compute a gradient micro-batch by micro-batch (abandoning it when told), time
it, and report it (:class:`WorkerReport`). The asynchronous loop around it is
:mod:`bdsgd.stages.engine.async_worker`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from bdsgd.stages.engine.config import EngineConfig
from bdsgd.stages.errors import BdsgdError
from bdsgd.stages.signals import ignore_ctrl_c
from bdsgd.stages.stragglers import parse_stragglers
from bdsgd.stages.wire import keys as P
from bdsgd.stages.wire.report import WorkerReport
from bdsgd.stages.workloads import Workload, error_line, load_workload


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs; plain values so it crosses a spawn boundary."""

    worker_id: int  # process id 1..N; trace worker is worker_id - 1
    store_host: str
    store_port: int
    bind_host: str
    cfg: EngineConfig
    local_rank: int = 0  # this worker's index among the workers of its machine (its GPU)


@dataclass
class Gradient:
    """One computation's outcome: the mini-batch loss (None if abandoned) and the samples whose
    gradient is accumulated in the model's ``.grad`` (all of them, unless abandoned)."""

    loss: float | None
    samples: int
    runtime_s: float
    delay_s: float
    start_s: float


class WorkerProcess:
    """What every worker loop sets up: its workload and data stream, its column of injected
    delays, the control store and the engine's clock origin."""

    def __init__(self, spec: WorkerSpec, device: torch.device | None = None):
        self.spec, cfg = spec, spec.cfg
        self.w = spec.worker_id - 1
        self.device = device or torch.device("cpu")
        use_device(self.device)
        torch.manual_seed(cfg.seed)
        self.workload: Workload = load_workload(cfg.workload, seed=cfg.seed)
        self.model = self.workload.model.to(self.device)
        self.gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + spec.worker_id)
        model = parse_stragglers(cfg.stragglers, cfg.seed, cfg.time_scale)
        self.delays = model.column(cfg.iterations, cfg.workers, self.w)
        self.c10d = P.open_store(spec.store_host, spec.store_port, False, cfg.timeout_s)
        self.t0_epoch = float(self.c10d.get(P.T0_KEY).decode())  # the engine's clock origin

    def mark_ready(self) -> None:
        """Tell the engine this worker has started (it counts no iteration time before)."""
        self.c10d.set(P.ready_key(self.w), "1")

    def delay(self, j: int) -> float:
        return float(self.delays[j % len(self.delays)])

    def compute(self, j: int, stop_key: str, cuttable: bool) -> Gradient:
        """Wait out delay j (ended early by ``stop_key``), then forward/backward micro-batch by
        micro-batch into the model's ``.grad`` (checking ``stop_key`` between micro-batches when
        ``cuttable``). The gradient is the mean over the samples done."""
        start, start_s = time.perf_counter(), time.time() - self.t0_epoch
        delay = self.delay(j)
        self.zero_grad()
        if delay > 0 and P.wait_key(self.c10d, stop_key, delay):
            return Gradient(None, 0, time.perf_counter() - start, delay, start_s)
        parts = self.spec.cfg.micro_batches if cuttable else 1
        waited = time.perf_counter() - start
        with self.timer() as elapsed:
            loss, samples = self.micro_batches(parts, lambda: self.c10d.check([stop_key]))
        return Gradient(loss, samples, waited + elapsed(), delay, start_s)

    grad: torch.Tensor | None = None  # one flat buffer the model's gradients are views into

    def zero_grad(self) -> None:
        """Zero the model's gradients (in one operation where they are views into ``grad``)."""
        if self.grad is not None:
            self.grad.zero_()
        else:
            self.model.zero_grad(set_to_none=False)

    @contextlib.contextmanager
    def timer(self):
        """Times the gradient: on a GPU with CUDA events around it, synchronised before the
        reading (device time, not kernel-launch time); on the CPU with the wall clock. Yields a
        function that returns the seconds once the block has run."""
        box: list[float] = []
        if self.device.type == "cuda":
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            begin.record()
            yield lambda: box[0]
            end.record()
            end.synchronize()
            box.append(begin.elapsed_time(end) / 1e3)
        else:
            tic = time.perf_counter()
            yield lambda: box[0]
            box.append(time.perf_counter() - tic)

    def micro_batches(self, parts: int, stop: Callable[[], bool]) -> tuple[float | None, int]:
        """The mini-batch's gradient in ``parts`` micro-batches; (loss, samples), or (None,
        samples done) when ``stop()`` says so between micro-batches. An iteration nobody can be
        cut from runs as one pass."""
        size = self.spec.cfg.batch_size
        with workload_code():
            x, y = self.workload.batch(self.gen, size)
            x, y = x.to(self.device), y.to(self.device)
        total, done = 0.0, 0
        for i, (xb, yb) in enumerate(zip(x.chunk(parts), y.chunk(parts), strict=True)):
            if i and stop():
                return None, done
            with workload_code():
                loss = self.workload.loss(self.model(xb), yb)
                if xb.shape[0] != size:  # a micro-batch's share of the mean over the mini-batch
                    loss = loss * (xb.shape[0] / size)
                loss.backward()
                total += loss.item()
            done += xb.shape[0]
        return total, done

    def report(self, j: int, grad: Gradient, version: int = 0) -> WorkerReport:
        loss = grad.loss if grad.loss is not None else float("nan")
        return WorkerReport(
            self.w, j, grad.start_s, grad.runtime_s, loss, grad.delay_s, version, grad.loss is None
        )


class WorkloadError(Exception):
    """The workload's own code failed in a worker (its batch, model, loss or backward)."""


@contextlib.contextmanager
def workload_code():
    """Around the workload's own code: its errors become :class:`WorkloadError`, which the
    worker reports (a failure of a peer, the store or the engine is not the workload's)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 (any error of the user's code)
        raise WorkloadError(error_line(exc)) from exc


def use_device(device: torch.device) -> None:
    """Make a worker's GPU its current device, before anything touches CUDA: CUDA events record
    on the current device's stream (else GPU 0's, while the model runs on GPU k, and the
    run-time measures the wrong device), and the process makes no context on GPU 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def worker_entry(body: Callable[[WorkerSpec], None], spec: WorkerSpec) -> None:
    """Entry point of a spawned worker process of any kind. Ctrl-C is the engine's to handle; a
    worker ends when told to stop, when its work is done, or when the engine or a peer goes away
    (quietly: the engine says why). An error of the workload's own code (its model failing, a
    GPU out of memory) is one line on stderr before it exits: the engine only sees a dead
    worker."""
    ignore_ctrl_c()  # (already, when spawned: bdsgd.stages.wire.spawned)
    P.quiet_c10d_logs()
    torch.set_num_threads(1)
    try:
        body(spec)
    except (WorkloadError, BdsgdError) as exc:  # (BdsgdError: the workload failed to load)
        line = f"bdsgd worker {spec.worker_id - 1}: {exc}\n".encode()
        os.write(sys.stderr.fileno(), line)  # one write: the workers' lines do not interleave
        raise SystemExit(1) from None
    except (TimeoutError, RuntimeError, dist.DistError):  # gloo's own errors are RuntimeError
        raise SystemExit(1) from None


def default_bind_host() -> str:
    return socket.gethostbyname(socket.gethostname())
