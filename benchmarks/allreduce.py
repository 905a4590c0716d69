"""The yardstick for the engine's overhead: plain synchronous data-parallel SGD with one gloo
``all_reduce`` of the flattened gradient per iteration, on the same workload and workers."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import time

import torch
import torch.distributed as dist
from bdsgd.stages.loop.group_exit import release_default_group
from bdsgd.stages.wire import keys as P
from bdsgd.stages.workloads import load_workload


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
    release_default_group()  # (the optimizer's import of torch.distributed.nn held the group)
    dist.destroy_process_group()


def allreduce_iterations_per_s(
    workers: int, iterations: int, workload: str = "mlp", batch: int = 32
) -> float:
    """Iterations per second of the all_reduce loop (after 5 warm-up iterations)."""
    store = P.open_store("127.0.0.1", 0, True, 60.0)  # (loopback alone)
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


def _sum_worker(
    rank: int, world: int, port: int, reps: int, mode: str, gap_s: float, size: int, q
) -> None:
    P.quiet_c10d_logs()
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    group = P.gloo_group(store, "sum/", rank, world, "127.0.0.1", 60.0)
    buf, inbox = torch.ones(size), [torch.empty(size) for _ in range(world - 1)]
    times = []
    for i in range(reps + 3):
        group.barrier().wait()
        buf.fill_(1.0)
        time.sleep(gap_s)  # every process idle, as while the stragglers of an iteration run
        tic = time.perf_counter()
        if mode == "ring":
            group.allreduce([buf]).wait()
        else:  # the star, as the collective engine's replicas run it
            P.star_sum(group, rank, world, buf, inbox)()
        if i >= 3:
            times.append(time.perf_counter() - tic)
    q.put(sorted(times)[len(times) // 2] * 1e3)


def sum_ms(
    workers: int, mode: str, gap_s: float = 0.02, reps: int = 40, size: int | None = None
) -> float:
    """Median milliseconds of one sum of ``size`` float32 (default: the mlp's gradient) among
    ``workers`` processes, by gloo's ring all-reduce (``ring``) or the star (``star``), each
    started after every process sat idle for ``gap_s``; the median over the processes."""
    if size is None:
        size = sum(p.numel() for p in load_workload("mlp", seed=0).model.parameters())
    store = P.open_store("127.0.0.1", 0, True, 60.0)  # (loopback alone)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = (workers, store.port, reps, mode, gap_s, size, q)
    procs = [ctx.Process(target=_sum_worker, args=(r, *args), daemon=True) for r in range(workers)]
    for p in procs:
        p.start()
    try:
        return float(sorted(q.get(timeout=300) for _ in procs)[workers // 2])
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def sum_table(repeats: int = 1) -> str:
    """Ring against star, 2, 4 and 6 processes (``python -c "from benchmarks.allreduce import
    sum_table; print(sum_table())"``, once as is and once under ``chrt -r 10``)."""
    lines = ["| processes | ring (ms, p50) | star (ms, p50) |", "|---|---|---|"]
    for n in (2, 4, 6):
        ring, star = (min(sum_ms(n, m) for _ in range(repeats)) for m in ("ring", "star"))
        lines.append(f"| {n} | {ring:.2f} | {star:.2f} |")
    return "\n".join(lines)


def size_table(sizes=(1_000_000, 4_000_000, 8_000_000, 16_000_000), reps: int = 10) -> str:
    """Ring against star by model size (float32 parameters), 2, 4 and 6 processes: where the
    star's N-fold traffic through one process outweighs the ring's scheduling waits (the
    threshold of ``--allreduce auto``). ``python -c "from benchmarks.allreduce import
    size_table; print(size_table())"``."""
    lines = ["| parameters | processes | ring (ms, p50) | star (ms, p50) | star / ring |",
             "|---|---|---|---|---|"]  # fmt: skip
    for size in sizes:
        for n in (2, 4, 6):
            ring, star = (sum_ms(n, m, reps=reps, size=size) for m in ("ring", "star"))
            lines.append(f"| {size / 1e6:g}M | {n} | {ring:.1f} | {star:.1f} | {star / ring:.2f} |")
    return "\n".join(lines)
