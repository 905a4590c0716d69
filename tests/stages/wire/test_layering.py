"""The worker side stands alone: a worker process imports the wire, the worker report and its
loop, and nothing of the engine's side (the coordinator and servers, the trace store, polars,
pyarrow, rich, Pyro)."""

from __future__ import annotations

import json
import subprocess
import sys

# every module a spawned worker of any variant loads: its first code, its spec and its loop
WORKER_SIDE = (
    "bdsgd.stages.engine.spawned",
    "bdsgd.stages.signals",
    "bdsgd.stages.engine.protocol",
    "bdsgd.stages.engine.worker_report",
    "bdsgd.stages.engine.worker",
    "bdsgd.stages.engine.replica",
    "bdsgd.stages.engine.replica_membership",
    "bdsgd.stages.engine.async_worker",
    "bdsgd.stages.loop.job",  # (--engine loop's ranks: the library's rank side)
)
ENGINE_SIDE = (
    "polars",
    "pyarrow",
    "rich",
    "pyro",
    "bdsgd.stages.store",
    "bdsgd.stages.console",
    "bdsgd.stages.policies",
    "bdsgd.stages.engine.base",
    "bdsgd.stages.engine.sync",
    "bdsgd.stages.engine.ps",
    "bdsgd.stages.engine.collective",
    "bdsgd.stages.engine.admission",
    "bdsgd.stages.engine.progress",
    "bdsgd.stages.engine.announcer",
    "bdsgd.stages.engine.regroup",
    "bdsgd.stages.engine.replica_outputs",
    "bdsgd.stages.engine.async_server",
    "bdsgd.stages.engine.launch",
    "bdsgd.stages.engine.janitor",
)

PROBE = """
import importlib, json, pickle, sys
for name in {modules!r}:
    importlib.import_module(name)
from bdsgd.stages.engine.config import EngineConfig
from bdsgd.stages.engine.worker import WorkerSpec
cfg = EngineConfig(workers=2, iterations=3, run_id="r", source="train")
pickle.loads(pickle.dumps(WorkerSpec(1, "127.0.0.1", 1, "127.0.0.1", cfg)))  # as spawned.run
print(json.dumps(sorted(sys.modules)))
"""


def test_worker_modules_import_nothing_of_the_engine_side():
    code = PROBE.format(modules=WORKER_SIDE)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert set(WORKER_SIDE) <= loaded  # (the probe did import them)
    leaked = sorted(m for m in loaded if m in ENGINE_SIDE or m.split(".")[0] in ENGINE_SIDE)
    leaked += sorted(m for m in loaded if any(m.startswith(f"{e}.") for e in ENGINE_SIDE))
    assert not leaked, f"the worker side imports the engine side: {leaked}"
