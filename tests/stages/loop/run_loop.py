"""One rank of a small cutoff-controlled training loop, for the tests of bdsgd.Cutoff: an MLP
with AdamW, linear warmup then cosine decay, gradient clipping and bf16 autocast on the CPU,
micro-batches from a DataLoader. Started once per rank with RANK, WORLD_SIZE, MASTER_PORT set;
writes what it saw to ``--result``/rank<r>.json."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from bdsgd.stages.loop.group_exit import held_defaults
from bdsgd.stages.wire.keys import open_store
from torch.utils.data import DataLoader, TensorDataset

import bdsgd


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stop-after", type=int, default=None, help="save and exit after this many")
    ap.add_argument("--policy", default="full")
    ap.add_argument("--stragglers", default="none")
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--salvage", action="store_true")
    ap.add_argument("--cut-relay", action="store_true", help="relay the cut through a local store")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--batchnorm", action="store_true", help="a BatchNorm layer in the model")
    ap.add_argument("--fill", help="rank 0 fills the disk holding this folder before its save")
    ap.add_argument("--check-every", type=int, default=100)
    ap.add_argument("--diverge-at", type=int, help="rank 1 moves a parameter after this step")
    ap.add_argument("--no-broadcast-buffers", action="store_true")
    ap.add_argument("--single", action="store_true", help="one process, no bdsgd: the reference")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--out")
    ap.add_argument("--traces")
    ap.add_argument("--grad-modes", default="none",
                    help="how each step clears the gradients, in turn: none (set to None), "
                         "keep (zeroed in place), foreign (new tensors the script sets)")  # fmt: skip
    ap.add_argument("--result", required=True)
    return ap.parse_args()


def setup(seed: int = 0, device: str = "cpu", batchnorm: bool = False):
    torch.manual_seed(seed)
    norm = [torch.nn.BatchNorm1d(32)] if batchnorm else []
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), *norm, torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[2])
    return model, opt, sched


def data(rank: int, world: int, per_rank: int = 16, steps: int = 32):
    g = torch.Generator().manual_seed(123)
    x = torch.randn(steps * world * per_rank, 8, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:].sum(1) > 0).long()
    ds = TensorDataset(x, y)
    # each step: rank r takes rows [step*world*per_rank + r*per_rank, ... + per_rank)
    idx = [
        s * world * per_rank + rank * per_rank + i for s in range(steps) for i in range(per_rank)
    ]
    return DataLoader(torch.utils.data.Subset(ds, idx), batch_size=per_rank, shuffle=False)


def loss_of(model, x, y):
    device = next(model.parameters()).device
    x, y = x.to(device), y.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(x)
    return torch.nn.functional.cross_entropy(out.float(), y)


def single(args) -> None:
    """The reference: one process takes every rank's batch at once, plain PyTorch."""
    model, opt, sched = setup()
    world = int(os.environ.get("REF_WORLD", "2"))
    loaders = [iter(data(r, world)) for r in range(world)]
    for _ in range(args.steps):
        xs, ys = zip(*(next(it) for it in loaders), strict=True)
        loss_of(model, torch.cat(xs), torch.cat(ys)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    write(args.result, 0, model, {})


def distributed(args) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = open_store("127.0.0.1", int(os.environ["MASTER_PORT"]), rank == 0, 120)
    dist.init_process_group(args.backend, store=store, rank=rank, world_size=world)
    model, opt, sched = setup(device=args.device, batchnorm=args.batchnorm)
    cut = bdsgd.Cutoff(model, policy=args.policy, micro_batches=args.micro_batches,
                       broadcast_buffers=not args.no_broadcast_buffers,
                       check_every=args.check_every,
                       salvage=args.salvage, stragglers=args.stragglers, out=args.out,
                       cut_relay=True if args.cut_relay else None,
                       traces=args.traces, timeout_s=120)  # fmt: skip
    start = cut.resume(opt, sched) if args.resume else 0
    batches = iter(data(rank, world))
    for _ in range(start):
        next(batches)
    seen = {"world_size": dist.get_world_size(), "start": start, "samples": [], "admitted": [],
            "cut": [], "in_buffer": []}  # fmt: skip
    modes = args.grad_modes.split(",")
    for step in range(start, args.steps):
        with cut.iteration() as it:
            for x, y in it.micro_batches(next(batches)):
                it.backward(loss_of(model, x, y))
        seen["in_buffer"].append(grads_in_buffer(cut))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        cut.step(opt)
        sched.step()
        clear_grads(model, opt, modes[step % len(modes)])
        if step == args.diverge_at and rank == 1:
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)
        seen["samples"].append(cut.last.samples)
        seen["admitted"].append(cut.last.admitted)
        seen["cut"].append(cut.last.cut)
        if args.stop_after is not None and step + 1 == args.stop_after:
            if args.fill and rank == 0:
                fill_disk(Path(args.fill))
            cut.save(opt, sched)
            break
    summary = cut.close()
    seen["summary"] = summary
    node = cut.node_cut  # where this rank looked for the cut, and what its relay passed on
    seen["local_view"] = node.view is not cut.c10d
    seen["relayed"] = node.relay.relayed if node.relay is not None else None
    seen["cuts_set"] = cut.cuts_set
    # AdamW's construction imported torch.distributed.nn after the group (its defaults held it)
    seen["held_after_close"] = held_defaults()
    dist.destroy_process_group()
    gc.collect()
    seen["gloo_threads_after_destroy"] = gloo_threads()
    write(args.result, rank, model, seen)


def fill_disk(folder: Path) -> None:
    """Write zeros into ``folder`` until its disk is full."""
    with open(folder / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
        except OSError:
            pass


def grads_in_buffer(cut) -> bool:
    """Whether every ``.grad`` is its slice of the all-reduce buffer (no copy in or out)."""
    pairs = zip(cut.params, cut.grad_views, strict=True)
    return all(p.grad.data_ptr() == view.data_ptr() for p, view in pairs)


def clear_grads(model, opt, mode: str) -> None:
    if mode == "foreign":  # the script's own zeroed tensors: bdsgd copies in and out
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    else:
        opt.zero_grad(set_to_none=mode == "none")


def gloo_threads() -> int | None:
    """Threads of this process that gloo's process group runs (None without /proc)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
    return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


def write(result: str, rank: int, model, seen: dict) -> None:
    seen["params"] = [p.detach().cpu().double().reshape(-1).tolist() for p in model.parameters()]
    seen["buffers"] = [b.detach().cpu().double().reshape(-1).tolist() for b in model.buffers()]
    os.makedirs(result, exist_ok=True)
    with open(os.path.join(result, f"rank{rank}.json"), "w") as fh:
        json.dump(seen, fh)


if __name__ == "__main__":
    arguments = parse()
    try:
        single(arguments) if arguments.single else distributed(arguments)
    finally:  # as docs/library.md asks: a group left alive can abort the exit (group_exit)
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(0)
