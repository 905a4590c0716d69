"""The asynchronous worker loop: receive parameters, wait out the injected delay, compute the
gradient, take an arrival ticket, send the gradient, and wait for fresh parameters -- which come
only once the server has applied this gradient. The worker's j-th computation waits out delay j of
its column (the same delays the synchronous worker plays), whatever the server's update count.

A worker stops when the server sends it a stop message instead of parameters, or, mid-computation,
when the store's stop key appears (checked during the delay and between micro-batches); it then
leaves its unfinished computation in its end key so the server can write it as censored.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from stages.engine import async_protocol as A
from stages.engine import protocol as P
from stages.engine.worker import WorkerProcess, WorkerSpec


class AsyncWorker(WorkerProcess):
    def __init__(self, spec: WorkerSpec):
        super().__init__(spec)
        n = parameters_to_vector(self.model.parameters()).numel()
        self.params = torch.zeros(A.PARAM_HEADER + n)
        self.group = None

    def run(self) -> None:
        self.store.add(A.READY, 1)
        if not self.wait_connect():
            return
        # the worker's side of the pair outwaits the server's: the server gives up on a worker
        # (and says so) before the worker gives up on it
        self.group = A.pair_group(
            self.store, self.w, 1, self.spec.bind_host, 2 * self.spec.timeout_s
        )
        while self.receive_params() and self.compute():
            pass

    def wait_connect(self) -> bool:
        """Wait (bounded) until the server builds the pairs; False if the run stopped first or
        goes on without this worker (it was dead when the run was checkpointed)."""
        deadline = time.monotonic() + self.spec.timeout_s
        while not P.wait_key(self.store, A.CONNECT, 0.2):
            if self.store.check([A.STOP]):
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.w}: no word from the server")
        return str(self.w) in self.store.get(A.CONNECT).decode().split(",")

    def receive_params(self) -> bool:
        """Block until the server sends parameters (True) or a stop message (False)."""
        self.group.recv([self.params], 0, A.PARAMS_TAG).wait()
        if float(self.params[0]) == A.STOP_VERSION:
            return False
        vector_to_parameters(self.params[A.PARAM_HEADER :], self.model.parameters())
        return True

    def compute(self) -> bool:
        """One computation on the parameters just received; False if the run stopped meanwhile."""
        version, j = int(self.params[0]), int(self.params[1])
        start, start_s = time.perf_counter(), time.time() - self.t0_epoch
        delay = float(self.delays[j % len(self.delays)])
        stopped = P.wait_key(self.store, A.STOP, delay)
        grad, loss = (None, 0.0) if stopped else self.gradient()
        runtime = time.perf_counter() - start
        if grad is None:
            self.store.set(A.end_key(self.w), A.encode_end(j, start_s, runtime, delay))
            return False
        ticket = self.store.add(A.ARRIVALS, 1)
        self.store.set(A.arrival_key(ticket), str(self.spec.worker_id))
        header = A.GradHeader(runtime, loss, self.w, version, j, start_s, delay)
        self.group.send([A.pack_grad(grad, header)], 0, A.GRAD_TAG).wait()
        return True

    def gradient(self) -> tuple[torch.Tensor | None, float]:
        """Forward/backward micro-batch by micro-batch; None if the run stops meanwhile."""
        self.model.zero_grad(set_to_none=False)
        x, y = self.workload.batch(self.gen, self.spec.batch_size)
        parts = self.spec.micro_batches
        total = 0.0
        for i, (xb, yb) in enumerate(zip(x.chunk(parts), y.chunk(parts), strict=True)):
            if i and self.store.check([A.STOP]):
                return None, 0.0
            loss = self.workload.loss(self.model(xb), yb) * (xb.shape[0] / x.shape[0])
            loss.backward()
            total += loss.item()
        grads = [
            p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()
        ]
        return torch.cat([g.reshape(-1) for g in grads]), total


def async_worker_main(spec: WorkerSpec) -> None:
    """Entry point of a spawned asynchronous worker. Ctrl-C is the server's to handle; a worker
    ends when told to stop or when the server goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    P.quiet_c10d_logs()
    torch.set_num_threads(1)
    try:
        AsyncWorker(spec).run()
    except (TimeoutError, RuntimeError, dist.DistError):
        raise SystemExit(1) from None
