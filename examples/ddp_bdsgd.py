r"""The tiny GPT-2 job of examples/ddp_plain.py with its all-reduce under a bdsgd cutoff policy:
each step waits for as many ranks as the policy finds worth it, and the stragglers stop at their
next micro-batch. Everything else (AdamW, warmup then cosine, clipping, bf16 autocast, the
DataLoader) is the plain script's.

    torchrun --standalone --nproc-per-node 4 examples/ddp_bdsgd.py --steps 200 --policy ecdf \
        --out runs/gpt2 --traces traces

With --out, every --save-every steps rank 0 saves runs/gpt2/checkpoint.pt (cut.save), and the
same command run again continues from it (cut.resume). "--policy full" only measures (the
profile of your own job); "bdsgd fit --traces traces --checkpoint model.pt" then fits the
run-time model that "--policy bdsgd --model model.pt" uses.
"""

from __future__ import annotations

import os

# c10d logs a warning for every store wait that times out, and bdsgd's waits time out by design;
# read when torch loads, so set first
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tinygpt import (  # noqa: E402
    Progress,
    arguments,
    build_loader,
    build_model,
    device_and_backend,
    warmup_cosine,
)

import bdsgd  # noqa: E402


def options(ap) -> None:
    ap.add_argument(
        "--policy", default="ecdf", help="cutoff policy: full, static:C, ecdf, ewma, bdsgd, ..."
    )
    ap.add_argument("--model", help="fitted run-time model (bdsgd fit), for --policy bdsgd")
    ap.add_argument("--out", help="run directory (bdsgd report reads it; checkpoints go here)")
    ap.add_argument("--traces", help="trace store the run appends to")
    ap.add_argument(
        "--save-every", type=int, default=50, help="steps between checkpoints (with --out)"
    )
    ap.add_argument("--no-salvage", dest="salvage", action="store_false",
                    help="a cut rank sends zeros, not the micro-batches it finished")  # fmt: skip


def main() -> None:
    args = arguments(__doc__, options)
    device, backend = device_and_backend()
    dist.init_process_group(backend if args.backend == "auto" else args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.seed, args.layers, args.width).to(device)
    try:
        cut = bdsgd.Cutoff(model, policy=args.policy, checkpoint=args.model, out=args.out,
                           traces=args.traces, micro_batches=args.micro_batches,
                           stragglers=args.stragglers, seed=args.seed, salvage=args.salvage)  # fmt: skip
    except bdsgd.BdsgdError as exc:  # every rank raises the same line: say it once
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        dist.barrier()  # the line is out before any rank exits (torchrun then stops the rest)
        dist.destroy_process_group()
        sys.exit(2)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = warmup_cosine(opt, args.warmup, args.steps)
    start = cut.resume(opt, sched) if args.out else 0  # the step after the last save, or 0
    loader = build_loader(args.batch_size, args.steps, world, rank, args.seed)
    batches = itertools.islice(loader, start, None)  # the data a resumed run has not seen
    progress = Progress(rank, args.steps, args.log_every, start)
    metrics, t0 = [], time.perf_counter()
    for step in range(start, args.steps):
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
        progress.step(step, cut.last.loss, f"  ranks admitted {cut.last.admitted}/{world}")
        if args.out and (step + 1) % args.save_every == 0:
            cut.save(opt, sched)  # every rank calls it; rank 0 writes <out>/checkpoint.pt
    summary = cut.close()
    if rank == 0 and args.metrics:
        with open(args.metrics, "w") as fh:
            json.dump({"steps": metrics, "summary": summary}, fh)
    dist.barrier()  # every rank done before any closes its connections
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
