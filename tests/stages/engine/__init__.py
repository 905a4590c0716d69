"""Tests of the distributed engine; :func:`write_replay_trace` builds straggler traces."""

from __future__ import annotations

from pathlib import Path

from stages.store import TraceStore


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
