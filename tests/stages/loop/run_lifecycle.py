"""One rank of a loop script that misuses or ends its ``bdsgd.Cutoff`` in the ways a user's loop
can: resuming from a checkpoint only some ranks see, an error raised inside an iteration, calls
after ``close()``. Started once per rank by launch.py (RANK, WORLD_SIZE, MASTER_PORT set); writes
what each call did to ``--result``/rank<r>.json."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from bdsgd.stages.wire.keys import open_store
from run_loop import setup  # (beside this script)

import bdsgd

# longer than the test's own timeout: a call that waits it out fails the test, never passes it
TIMEOUT_S = 3600.0


def outcome(call) -> str:
    """What ``call()`` did: ``ok <value>`` or ``<ErrorClass>: <message>``."""
    try:
        return f"ok {call()!r}"
    except Exception as exc:  # (the test asserts on the class and the message)
        return f"{type(exc).__name__}: {exc}"


def one_iteration(cut, model, opt) -> None:
    with cut.iteration() as it:
        for x in it.micro_batches(torch.randn(4, 8)):
            it.backward(model(x).pow(2).mean())
    cut.step(opt)
    opt.zero_grad(set_to_none=True)


def resume(cut, model, opt, sched, work: Path, rank: int) -> dict:
    """A checkpoint only rank 0 sees (another path on rank 1, as without a shared filesystem),
    then a directory given as the checkpoint, then calls after close()."""
    for _ in range(2):
        one_iteration(cut, model, opt)
    saved = cut.save(opt, sched, path=work / "rank0" / "checkpoint.pt")
    mine = saved if rank == 0 else work / "rank1" / "checkpoint.pt"
    seen = {"split": outcome(lambda: cut.resume(opt, sched, path=mine)),
            "directory": outcome(lambda: cut.resume(opt, sched, path=work)),
            "same": outcome(lambda: cut.resume(opt, sched, path=saved))}  # fmt: skip
    return {**seen, **after_close(cut, model, opt, sched)}


def broken(cut, model, opt, sched, work: Path, rank: int) -> dict:
    """An error inside the second iteration that the loop catches (a skipped bad batch)."""
    one_iteration(cut, model, opt)
    try:
        with cut.iteration():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (emulated)")
    except torch.cuda.OutOfMemoryError:
        pass
    seen = {"iteration": outcome(cut.iteration), "save": outcome(lambda: cut.save(opt, sched)),
            "step": outcome(lambda: cut.step(opt))}  # fmt: skip
    return {**seen, **after_close(cut, model, opt, sched)}


def unbacked(cut, model, opt, sched, work: Path, rank: int) -> dict:
    """A loop that leaves its micro-batches with a break before it.backward: bdsgd's own error,
    raised as the iteration ends, which the loop catches."""
    one_iteration(cut, model, opt)
    try:
        with cut.iteration() as it:
            for _ in it.micro_batches(torch.randn(4, 8)):
                break
    except bdsgd.BdsgdError as exc:
        ended = f"{type(exc).__name__}: {exc}"
    seen = {"ended": ended, "iteration": outcome(cut.iteration)}
    return {**seen, **after_close(cut, model, opt, sched)}


def after_close(cut, model, opt, sched) -> dict:
    return {"close": outcome(lambda: "summary" if cut.close() is not None else None),
            "close_again": outcome(cut.close), "iteration_after_close": outcome(cut.iteration),
            "save_after_close": outcome(lambda: cut.save(opt, sched)),
            "step_after_close": outcome(lambda: cut.step(opt))}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", choices=["resume", "broken", "unbacked"], required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = open_store("127.0.0.1", int(os.environ["MASTER_PORT"]), rank == 0, 120)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model, opt, sched = setup()
    cut = bdsgd.Cutoff(model, policy="full", micro_batches=2, timeout_s=TIMEOUT_S,
                       out=str(Path(args.work) / "run"))  # fmt: skip
    scenario = {"resume": resume, "broken": broken, "unbacked": unbacked}[args.scenario]
    seen = scenario(cut, model, opt, sched, Path(args.work), rank)
    dist.destroy_process_group()
    os.makedirs(args.result, exist_ok=True)
    Path(args.result, f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
    sys.exit(0)
