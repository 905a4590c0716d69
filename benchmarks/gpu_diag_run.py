"""Diagnosis of measure-only's host cost on a GPU (run under torchrun, one rank): runs
examples/ddp_bdsgd.py with the loop's pieces timed, and with DIAG=<variant> some syncs removed
(timing only; the removed ones change what is measured, not the training):

- base: as shipped
- nomark: no wait per micro-batch
- nosync: no wait per micro-batch, none at the end of compute (run-time by the host's clock,
  the loss not read before the all-reduce)
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from bdsgd.stages.loop import coordinator as C  # noqa: E402
from bdsgd.stages.loop import rank as R  # noqa: E402
from bdsgd.stages.loop import timing as T  # noqa: E402

SPENT: dict = defaultdict(float)
CALLS: dict = defaultdict(int)


def timed(owner, name, tag=None, clock=time.perf_counter):
    inner = getattr(owner, name)

    def wrapper(*a, **k):
        tic = clock()
        try:
            return inner(*a, **k)
        finally:
            SPENT[tag or name] += clock() - tic
            CALLS[tag or name] += 1

    setattr(owner, name, wrapper)


variant = os.environ.get("DIAG", "base")
if variant in ("nomark", "nosync"):

    def mark(self):
        if self.cuda:
            self.events.append(self._event())

    T.ComputeTimer.mark = mark
if variant == "nosync":
    T.ComputeTimer.stop = lambda self: time.perf_counter() - self.begun
    R.Iteration.loss_mean = lambda self: 0.0

for name in ("__enter__", "__exit__", "_take_ticket", "_finish_micro_batch"):
    timed(R.Iteration, name)
for name in ("_all_reduce", "step", "_attach_grads"):
    timed(R.Cutoff, name)
timed(T.ComputeTimer, "stop", "timer.stop")
timed(C.LoopCoordinator, "_iteration", "coordinator_cpu", clock=time.thread_time)
timed(C.LoopCoordinator, "_iteration", "coordinator_wall")

out = os.environ.get("DIAG_OUT")
sys.argv = [str(ROOT / "examples" / "ddp_bdsgd.py"), *sys.argv[1:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    if out:
        steps = max(CALLS["__exit__"], 1)
        Path(out).write_text(
            json.dumps(
                {
                    "variant": variant,
                    "steps": steps,
                    "ms_per_step": {k: 1e3 * v / steps for k, v in sorted(SPENT.items())},
                }
            )
        )
