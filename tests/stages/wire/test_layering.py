"""Layering: a worker process imports the wire, the worker report and its loop, and nothing of
the coordinating side (the server, the trace store, polars, pyarrow, rich, Pyro); the library's
loop imports no stage module and no engine module; no stage imports the CLI."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

STAGES = Path(__file__).resolve().parents[3] / "stages"

# every module a spawned worker of any variant loads: its first code, its spec and its loop
WORKER_SIDE = (
    "bdsgd.stages.wire.spawned",
    "bdsgd.stages.signals",
    "bdsgd.stages.wire.keys",
    "bdsgd.stages.wire.report",
    "bdsgd.stages.engine.worker",
    "bdsgd.stages.engine.async_worker",
    "bdsgd.stages.loop.job",  # (the library's rank side)
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
    "bdsgd.stages.engine.async_server",
    "bdsgd.stages.engine.launch",
    "bdsgd.stages.wire.janitor",
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


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (lazy imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


STAGE_MODULES = ("train", "profile", "fit", "simulate", "report", "loop_runs", "importer")


def test_the_loop_imports_no_stage_and_no_engine():
    forbidden = ("bdsgd.stages.engine", *(f"bdsgd.stages.{m}" for m in STAGE_MODULES))
    found = {
        f"{path.name}: {name}"
        for path in (STAGES / "loop").glob("*.py")
        for name in imported_modules(path)
        if name.startswith(forbidden)
    }
    assert not found


def test_no_stage_imports_the_cli():
    found = {
        f"{path.relative_to(STAGES)}: {name}"
        for path in STAGES.rglob("*.py")
        for name in imported_modules(path)
        if name.startswith("bdsgd_cli")
    }
    assert not found


def test_the_wire_imports_no_stage_and_no_engine():
    allowed = ("bdsgd.stages.wire", "bdsgd.stages.errors", "bdsgd.stages.signals")
    found = {
        f"{path.name}: {name}"
        for path in (STAGES / "wire").glob("*.py")
        for name in imported_modules(path)
        if name.startswith("bdsgd.") and not name.startswith(allowed)
    }
    assert not found
