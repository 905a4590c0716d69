"""Fixtures shared across the test suite. Keep this small and generic."""

from __future__ import annotations

import signal

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


@pytest.fixture(autouse=True)
def sigint_raises_keyboard_interrupt():
    """Every test starts with Python's own SIGINT handler, whatever disposition pytest inherited
    (a background job of a non-interactive shell, ``nohup`` or a CI runner starts with SIGINT
    ignored): a test that sends this process a Ctrl-C depends on it. The disposition found is
    restored after the test."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
