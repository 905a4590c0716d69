"""A workload with what a modern job has (``--workload tests.stages.loop.adamw_workload:adamw``):
AdamW, linear warmup then cosine decay, gradient clipping, bf16 autocast and a ``DataLoader``
over this rank's shard. ``fail_at`` (environment ``ADAMW_FAIL_AT=rank:batch``) makes one rank's
data raise, as a user's data pipeline can."""

from __future__ import annotations

import dataclasses
import math
import os

import torch
from bdsgd.stages.workloads import Workload, mlp
from torch.utils.data import DataLoader, Subset, TensorDataset

WARMUP, HORIZON = 4, 40  # the schedule's steps: fixed, so a resumed run follows the same one


def warmup_cosine(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    progress = min((step - WARMUP) / (HORIZON - WARMUP), 1.0)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def adamw(seed: int = 0) -> Workload:
    base = mlp(seed, dim=16, hidden=32)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 16, generator=gen)
    y = base.batch(torch.Generator().manual_seed(seed + 1), 1024)[1]
    fail_rank, _, fail_batch = os.environ.get("ADAMW_FAIL_AT", "-1:-1").partition(":")

    def data(rank: int, world: int, batch_size: int, seed: int):
        shard = Subset(TensorDataset(x[:, :16], y), list(range(rank, 1024, world)))
        for i, batch in enumerate(DataLoader(shard, batch_size=batch_size, drop_last=True)):
            if rank == int(fail_rank) and i == int(fail_batch):
                raise RuntimeError(f"rank {rank}: the data pipeline broke at batch {i}")
            yield batch

    return dataclasses.replace(
        base,
        name="adamw",
        model=torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
        ),
        eval_batch=(x[:64], y[:64]),
        optimizer=lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.1),
        scheduler=lambda opt, iterations: torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine),
        data=data,
        autocast=torch.bfloat16,
        clip_norm=1.0,
    )
