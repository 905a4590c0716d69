"""Fixtures shared across the test suite. Keep this small and generic."""

from __future__ import annotations

import pytest


def make_trace_rows(
    iterations: int = 2,
    workers: int = 2,
    run_id: str = "run-a",
    source: str = "profile",
    runtime_s: float = 1.0,
) -> dict[str, list]:
    """Column-wise rows of one valid schema-v1 run: every (iteration, worker) once, run-time
    ``runtime_s * (1 + worker)``, hosts ``h0``/``h1`` alternating, nothing censored."""
    cells = [(t, w) for t in range(iterations) for w in range(workers)]
    runtimes = [runtime_s * (1 + w) for _, w in cells]
    return {
        "run_id": [run_id] * len(cells),
        "iteration": [t for t, _ in cells],
        "worker": [w for _, w in cells],
        "host": [f"h{w % 2}" for _, w in cells],
        "world_size": [workers] * len(cells),
        "start_s": [t * runtime_s * workers for t, _ in cells],
        "runtime_s": runtimes,
        "censored": [False] * len(cells),
        "cutoff": [None] * len(cells),
        "policy": ["full"] * len(cells),
        "source": [source] * len(cells),
    }


@pytest.fixture
def trace_rows():
    """The :func:`make_trace_rows` builder, for tests that take fixtures."""
    return make_trace_rows
