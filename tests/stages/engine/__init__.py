"""Tests of the distributed engine; :func:`write_replay_trace` builds straggler traces,
:func:`sigint_after` sends a real Ctrl-C mid-run, :func:`exit_codes_of_workers` tells whether
the workers stopped on their own."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from bdsgd.stages.store import TraceStore


def write_replay_trace(path: Path, runtimes: list[list[float]]) -> Path:
    """A schema-v1 store of one run whose run-time of (iteration t, worker w) is
    ``runtimes[t][w]``: the delays ``--stragglers replay:PATH`` injects."""
    cells = [(t, w) for t in range(len(runtimes)) for w in range(len(runtimes[0]))]
    TraceStore(path).append(
        {
            "run_id": ["recorded"] * len(cells),
            "iteration": [t for t, _ in cells],
            "worker": [w for _, w in cells],
            "host": [f"h{w}" for _, w in cells],
            "world_size": [len(runtimes[0])] * len(cells),
            "start_s": [float(t) for t, _ in cells],
            "runtime_s": [runtimes[t][w] for t, w in cells],
            "censored": [False] * len(cells),
            "cutoff": [None] * len(cells),
            "policy": ["full"] * len(cells),
            "source": ["import"] * len(cells),
        }
    )
    return path


def sigint_after(engine_class, method: str, t_at: int, monkeypatch) -> None:
    """A real SIGINT to this process right after ``method(t_at)`` of the engine returns."""
    original = getattr(engine_class, method)

    def patched(self, t, *args):
        out = original(self, t, *args)
        if t == t_at:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(engine_class, method, patched)


def exit_codes_of_workers(monkeypatch) -> list[int | None]:
    """The exit codes of the run's worker processes once the launcher has reaped them (a
    negative one: killed by a signal, so it did not stop on its own)."""
    from bdsgd.stages.engine import launch

    codes: list[int | None] = []
    reap = launch.join_or_kill

    def join_or_kill(procs, *args, **kwargs):
        reap(procs, *args, **kwargs)
        codes.extend(p.exitcode for p in procs)

    monkeypatch.setattr(launch, "join_or_kill", join_or_kill)
    return codes


def engine_config(**overrides):
    """A small parameter-server config (4 workers, 16 updates)."""
    from bdsgd.stages.engine.config import EngineConfig

    values = dict(
        workers=4,
        iterations=16,
        run_id="engine-test",
        source="train",
        batch_size=16,
        micro_batches=4,
        record_batch=5,
        timeout_s=20.0,
        hosts=("h0", "h1", "h2", "h3"),
    )
    return EngineConfig(**{**values, **overrides})


def kill_worker_at(iteration: int, name: str):
    """An ``on_iteration`` callback that kills the worker process ``name`` after ``iteration``."""
    import multiprocessing

    def on_iteration(t: int, row: dict) -> None:
        if t == iteration:
            victim = [p for p in multiprocessing.active_children() if p.name == name]
            victim[0].kill()
            victim[0].join(5)

    return on_iteration
