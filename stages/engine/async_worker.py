"""The asynchronous worker loop: receive parameters, compute the gradient (injected delay first),
take an arrival ticket, report, send the gradient, and wait for fresh parameters -- which come only
once the server has applied this gradient. The worker's j-th computation waits out delay j of its
column (the same delays the synchronous worker plays), whatever the server's update count.

A worker stops when the server sends it a stop message instead of parameters, or, mid-computation,
when the store's stop key appears (checked during the delay and between micro-batches); it then
leaves its unfinished computation's censored report under its end key.
"""

from __future__ import annotations

import time

import torch
from bdsgd.stages.engine.worker import WorkerProcess, WorkerSpec, worker_entry
from bdsgd.stages.wire import keys as P
from torch.nn.utils import parameters_to_vector, vector_to_parameters


class AsyncWorker(WorkerProcess):
    def __init__(self, spec: WorkerSpec):
        super().__init__(spec)
        n = parameters_to_vector(self.model.parameters()).numel()
        self.params = torch.zeros(P.PARAM_HEADER + n)
        self.group = None

    def run(self) -> None:
        self.mark_ready()
        if not self.wait_connect():
            return
        # the worker's side of the pair outwaits the server's: the server gives up on a worker
        # (and says so) before the worker gives up on it
        timeout = 2 * self.spec.cfg.timeout_s
        self.group = P.pair_group(self.c10d, self.w, 1, self.spec.bind_host, timeout)
        while self.receive_params() and self.computation():
            pass

    def wait_connect(self) -> bool:
        """Wait until the server builds the pairs (once every worker started: bounded by
        ``--start-timeout`` and ``--timeout``); False if the run stopped first or goes on
        without this worker (it was dead when the run was checkpointed)."""
        deadline = time.monotonic() + self.spec.cfg.start_timeout_s + self.spec.cfg.timeout_s
        while not P.wait_key(self.c10d, P.ASYNC_CONNECT, 0.2):
            if self.c10d.check([P.ASYNC_STOP]):
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.w}: no word from the server")
        return str(self.w) in self.c10d.get(P.ASYNC_CONNECT).decode().split(",")

    def receive_params(self) -> bool:
        """Block until the server sends parameters (True) or a stop message (False)."""
        self.group.recv([self.params], 0, P.ASYNC_PARAMS_TAG).wait()
        if float(self.params[0]) == P.STOP_VERSION:
            return False
        vector_to_parameters(self.params[P.PARAM_HEADER :], self.model.parameters())
        return True

    def computation(self) -> bool:
        """One computation on the parameters just received; False if the run stopped meanwhile."""
        version, j = int(self.params[0]), int(self.params[1])
        grad = self.compute(j, P.ASYNC_STOP, cuttable=True)
        report = self.report(j, grad, version)
        if grad.loss is None:
            self.c10d.set(P.async_end_key(self.w), report.encode())
            return False
        ticket = self.c10d.add(P.ASYNC_ARRIVALS, 1)
        self.c10d.set(P.async_arrival_key(ticket), report.encode())
        flat = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])
        self.group.send([flat], 0, P.ASYNC_GRAD_TAG).wait()
        return True


def async_worker_main(spec: WorkerSpec) -> None:
    worker_entry(lambda s: AsyncWorker(s).run(), spec)
