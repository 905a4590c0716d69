"""The worker loop: wait for parameters, wait out the injected delay, compute the gradient, take a
ticket, send the gradient if admitted, record the iteration. Stragglers abandon an iteration as
soon as its cut key appears (during the delay at once, during computation at the next
micro-batch boundary). When every worker sent the iteration is admitted (c = their number) no
ticket can cut anyone, so the computation skips those checks; a server that gives up on such an
iteration (a death, a timeout, Ctrl-C) still has receives posted for its late senders."""

from __future__ import annotations

import signal
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from stages.engine import protocol as P
from stages.stragglers import parse_stragglers
from stages.workloads import Workload, load_workload


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs; plain values so it crosses a spawn boundary."""

    worker_id: int  # process id 1..N; trace worker is worker_id - 1
    num_workers: int
    store_host: str
    store_port: int
    bind_host: str
    workload: str
    batch_size: int
    micro_batches: int
    stragglers: str
    time_scale: float
    seed: int
    iterations: int
    record_batch: int
    timeout_s: float


class WorkerProcess:
    """What every worker loop (sync and asynchronous) sets up: its workload and data stream, its
    column of injected delays, the control store and the server's clock origin."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.w = spec.worker_id - 1
        torch.manual_seed(spec.seed)
        self.workload: Workload = load_workload(spec.workload, seed=spec.seed)
        self.model = self.workload.model
        self.gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + spec.worker_id)
        delays = parse_stragglers(spec.stragglers, spec.seed, spec.time_scale)
        self.delays = delays.delays(spec.iterations, spec.num_workers)[:, self.w]
        self.store = P.open_store(spec.store_host, spec.store_port, False, spec.timeout_s)
        self.t0_epoch = float(self.store.get("t0").decode())  # the server's clock origin


class Worker(WorkerProcess):
    def __init__(self, spec: WorkerSpec):
        super().__init__(spec)
        self.generation, self.group, self.members = -1, None, [0]
        size = parameters_to_vector(self.model.parameters()).numel()
        # the model's parameters and gradients live inside the payloads: no copies per iteration
        self.params = torch.zeros(P.PARAM_HEADER + size)
        self.grad = torch.zeros(P.GRAD_HEADER + size)
        P.bind_flat(
            self.model.parameters(), self.params[P.PARAM_HEADER :], self.grad[P.GRAD_HEADER :]
        )

    def run(self) -> None:
        t = int(self.store.get("start_iteration").decode())
        self.store.add(P.READY, 1)
        while t < self.spec.iterations:
            announced = self.wait_for(P.go_key(t))
            if announced == P.STOP:
                return
            self.join_generation(int(announced))
            t = self.iteration()
        self.store.add("workers_done", 1)

    def wait_for(self, key: str) -> str:
        """Block (bounded by the store's timeout) until the server announces; the server's death
        ends the wait."""
        value = P.get_key(self.store, key)
        if value is None:
            raise TimeoutError(
                f"worker {self.w}: no word from the server for {self.spec.timeout_s}s"
            )
        return value.decode()

    def join_generation(self, generation: int) -> None:
        if generation != self.generation:
            self.members = P.decode_members(self.store.get(P.members_key(generation)))
            self.group = P.build_group(
                self.store,
                generation,
                self.members,
                self.spec.worker_id,
                self.spec.bind_host,
                self.spec.timeout_s,
            )
            self.generation = generation

    def iteration(self) -> int:
        """Run the announced iteration; returns the next iteration index."""
        self.group.recv([self.params], 0, P.PARAMS_TAG).wait()
        start, wall_start = time.perf_counter(), time.time()
        t, cutoff = (int(v) for v in self.params[: P.PARAM_HEADER].tolist())
        delay = float(self.delays[t % len(self.delays)])
        cut = delay > 0 and P.wait_key(self.store, P.cut_key(t), delay)
        workers = len(self.members) - 1
        loss = None if cut else self.gradient(t, cuttable=cutoff == P.ONLINE or cutoff < workers)
        runtime = time.perf_counter() - start
        censored = loss is None
        if loss is not None:
            self.submit(t, cutoff, runtime, loss)
        rec = P.Record(t, wall_start - self.t0_epoch, runtime, censored, delay)
        self.store.append(P.record_key(self.w, t // self.spec.record_batch), rec.encode())
        return t + 1

    def gradient(self, t: int, cuttable: bool) -> float | None:
        """Forward/backward micro-batch by micro-batch into the gradient payload; returns the
        loss, or None if the iteration is cut meanwhile (checked only when ``cuttable``)."""
        self.model.zero_grad(set_to_none=False)
        x, y = self.workload.batch(self.gen, self.spec.batch_size)
        chunks = list(
            zip(x.chunk(self.spec.micro_batches), y.chunk(self.spec.micro_batches), strict=True)
        )
        total = 0.0
        for i, (xb, yb) in enumerate(chunks):
            if i and cuttable and self.store.check([P.cut_key(t)]):
                return None
            loss = self.workload.loss(self.model(xb), yb) * (xb.shape[0] / x.shape[0])
            loss.backward()
            total += loss.item()
        return total

    def submit(self, t: int, cutoff: int, runtime: float, loss: float) -> None:
        """Take a ticket; tickets 1..cutoff send their gradient, ticket ``cutoff`` cuts the rest.
        With ``cutoff`` ONLINE the server closes the iteration when it has enough (it adds
        CLOSED to the counter, so later tickets exceed every worker count)."""
        ticket = self.store.add(P.ticket_key(t), 1)
        limit = cutoff if cutoff != P.ONLINE else len(self.members) - 1
        if ticket > limit:
            return
        self.store.set(P.arrival_key(t, ticket), P.encode_arrival(self.spec.worker_id, runtime))
        if ticket == cutoff:
            self.store.set(P.cut_key(t), "1")
        self.grad[: P.GRAD_HEADER] = torch.tensor([runtime, loss, float(self.w)])
        self.group.send([self.grad], 0, P.GRAD_TAG).wait()


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a spawned worker process. Ctrl-C is the server's to handle; a worker ends
    when told to stop, when its work is done, or when the server goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    P.quiet_c10d_logs()
    torch.set_num_threads(1)
    try:
        Worker(spec).run()
    except (TimeoutError, RuntimeError, dist.DistError):
        raise SystemExit(1) from None


def default_bind_host() -> str:
    return socket.gethostbyname(socket.gethostname())
