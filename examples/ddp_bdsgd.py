"""The tiny GPT-2 job of examples/ddp_plain.py with its all-reduce under a bdsgd cutoff policy:
each step waits for as many ranks as the policy finds worth it, and the stragglers stop at their
next micro-batch. Everything else (AdamW, warmup then cosine, clipping, bf16 autocast, the
DataLoader) is the plain script's.

    torchrun --standalone --nproc-per-node 4 examples/ddp_bdsgd.py --steps 200 --policy ecdf \
        --out runs/gpt2 --traces traces

``--policy full`` only measures (the profile of your own job); ``bdsgd fit --traces traces
--checkpoint model.pt`` then fits the run-time model ``--policy bdsgd --model model.pt`` uses.
"""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist
from tinygpt import arguments, build_loader, build_model, device_and_backend, warmup_cosine

import bdsgd


def options(ap) -> None:
    ap.add_argument("--policy", default="ecdf")
    ap.add_argument("--model", help="fitted run-time model (bdsgd fit), for --policy bdsgd")
    ap.add_argument("--out", help="run directory (bdsgd report reads it)")
    ap.add_argument("--traces", help="trace store the run appends to")
    ap.add_argument("--no-salvage", dest="salvage", action="store_false",
                    help="a cut rank sends zeros, not the micro-batches it finished")  # fmt: skip


def main() -> None:
    args = arguments(options)
    device, backend = device_and_backend()
    dist.init_process_group(backend if args.backend == "auto" else args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.seed, args.layers, args.width).to(device)
    cut = bdsgd.Cutoff(model, policy=args.policy, checkpoint=args.model, out=args.out,
                       traces=args.traces, micro_batches=args.micro_batches,
                       stragglers=args.stragglers, seed=args.seed, salvage=args.salvage)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = warmup_cosine(opt, args.warmup, args.steps)
    batches = iter(build_loader(args.batch_size, args.steps, world, rank, args.seed))
    metrics, t0 = [], time.perf_counter()
    for step in range(args.steps):
        tokens = next(batches).to(device)
        with cut.iteration() as it:
            for micro in it.micro_batches(tokens):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(micro, labels=micro).loss
                it.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        cut.step(opt)
        sched.step()
        opt.zero_grad(set_to_none=True)
        metrics.append((step, time.perf_counter() - t0, cut.last.loss, cut.last.admitted))
    summary = cut.close()
    if rank == 0 and args.metrics:
        with open(args.metrics, "w") as fh:
            json.dump({"steps": metrics, "summary": summary}, fh)
    dist.barrier()  # every rank done before any closes its connections
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
