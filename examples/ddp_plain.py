"""A tiny GPT-2 trained with plain DistributedDataParallel: AdamW, warmup then cosine decay,
gradient clipping, bf16 autocast, gradient accumulation over micro-batches.

    torchrun --standalone --nproc-per-node 4 examples/ddp_plain.py --steps 200

examples/ddp_bdsgd.py is the same job with its all-reduce under a cutoff policy.
"""

from __future__ import annotations

import os

# c10d logs a warning for every store wait that times out; read when torch loads, so set first
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import contextlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tinygpt import (  # noqa: E402
    Delays,
    Progress,
    arguments,
    build_loader,
    build_model,
    device_and_backend,
    warmup_cosine,
)
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def main() -> None:
    args = arguments(__doc__)
    device, backend = device_and_backend()
    dist.init_process_group(backend if args.backend == "auto" else args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.seed, args.layers, args.width).to(device)
    model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = warmup_cosine(opt, args.warmup, args.steps)
    batches = iter(build_loader(args.batch_size, args.steps, world, rank, args.seed))
    delays = Delays(args.stragglers, world, rank, args.seed)  # emulated stragglers (benchmarks)
    progress = Progress(rank, args.steps, args.log_every)
    metrics, t0 = [], time.perf_counter()
    for step in range(args.steps):
        tokens, step_loss = next(batches).to(device), 0.0
        for i, micro in enumerate(tokens.chunk(args.micro_batches)):
            delays.sleep(step, args.micro_batches)
            last = i == args.micro_batches - 1
            with contextlib.nullcontext() if last else model.no_sync():
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(micro, labels=micro).loss
                (loss / args.micro_batches).backward()
            step_loss += loss.detach() / args.micro_batches
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        metrics.append((step, time.perf_counter() - t0, float(step_loss)))
        progress.step(step, float(step_loss))
    if rank == 0 and args.metrics:
        with open(args.metrics, "w") as fh:
            json.dump({"steps": metrics}, fh)
    dist.barrier()  # every rank done before any closes its connections
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
