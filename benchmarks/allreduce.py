"""The yardstick for the engine's overhead: plain synchronous data-parallel SGD with one gloo
``all_reduce`` of the flattened gradient per iteration, on the same workload and workers."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import time

import torch
import torch.distributed as dist

from stages.engine import protocol as P
from stages.workloads import load_workload


def _worker(
    rank: int, world: int, port: int, iterations: int, workload: str, batch: int, q
) -> None:
    P.quiet_c10d_logs()
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    wl = load_workload(workload, seed=0)
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    params = list(wl.model.parameters())
    for t in range(iterations + 5):
        if t == 5:
            dist.barrier()
            start = time.perf_counter()
        opt.zero_grad()
        x, y = wl.batch(gen, batch)
        wl.loss(wl.model(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
    if rank == 0:
        q.put(iterations / (time.perf_counter() - start))
    dist.destroy_process_group()


def allreduce_iterations_per_s(
    workers: int, iterations: int, workload: str = "mlp", batch: int = 32
) -> float:
    """Iterations per second of the all_reduce loop (after 5 warm-up iterations)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, workers, store.port, iterations, workload, batch, q),
            daemon=True,
        )
        for r in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        return float(q.get(timeout=300))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
