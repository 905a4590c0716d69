"""A run directory's resume state for ``--resume``: the engine's state (:data:`STATE_FILE`, after
every ``record_batch``-th iteration at most once per ``record_s`` seconds, and at the end) and
the iteration log's older rows in segment files (``log/rows-<k>.pt``, ``SEGMENT_ROWS`` rows each,
each written once).

A state holding the whole log would cost more the longer the run (0.1 s at 10^4 iterations,
0.55 s at 10^5, every 25 iterations). So a row moves into a segment once ``SETTLE_ROWS`` later
rows exist (a late held-out loss is in by then), and the state holds the rows after the last segment: it costs the same at iteration
10^6 as at 10^3. Every file is written under a temporary name and renamed into place, segments
before the state that counts them, and read with ``weights_only`` (plain lists, no code).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from bdsgd.stages.errors import CheckpointError
from bdsgd.stages.safe_load import load_plain, save_atomic

STATE_FILE = "engine_state.pt"
LOG_DIR = "log"
SEGMENT_ROWS = 1024  # iteration-log rows per segment file
SETTLE_ROWS = 64  # rows after a segment before it is written (late held-out losses are in)


def segment_path(run_dir: Path, k: int) -> Path:
    return run_dir / LOG_DIR / f"rows-{k:06d}.pt"


def state_path(run_dir: Path) -> Path:
    """The state file ``run_dir`` resumes from."""
    return run_dir / STATE_FILE


class Checkpointer:
    """Writes the checkpoints of one run directory; ``segments`` already there (a resumed run)."""

    def __init__(self, run_dir: Path, segments: int = 0):
        self.run_dir, self.segments = run_dir, segments

    def save(self, state: dict, then: Callable[[], None] | None = None) -> None:
        """Write ``state`` (its ``log`` the whole iteration log), settled rows into segments.
        ``then`` makes what the state counts durable (the trace rows): it runs once the state
        is on disk under its temporary name, before the rename that makes it the checkpoint, so
        neither runs ahead of the other."""
        log = state["log"]
        rows = len(log.get("iteration", []))
        done = self.segments * SEGMENT_ROWS
        while rows - done >= SEGMENT_ROWS + SETTLE_ROWS:
            segment = {k: v[done : done + SEGMENT_ROWS] for k, v in log.items()}
            save_atomic(segment, segment_path(self.run_dir, self.segments))
            self.segments, done = self.segments + 1, done + SEGMENT_ROWS
        tail = {k: v[done:] for k, v in log.items()}
        save_atomic({**state, "log": tail, "log_segments": self.segments},
                    self.run_dir / STATE_FILE, then)  # fmt: skip


def with_whole_log(run_dir: Path, state: dict) -> dict:
    """``state`` (as read from ``run_dir``'s checkpoint) with its whole iteration log: its
    segments' rows, then its own. A missing or inconsistent segment is a CheckpointError."""
    segments = int(state.get("log_segments", 0))
    tail = state["log"]
    log: dict[str, list] = {k: [] for k in tail}
    for k in range(segments):
        path = segment_path(run_dir, k)
        part = load_plain(path, "iteration log segment")
        lengths = {len(v) if isinstance(v, list) else -1 for v in part.values()}
        if set(part) != set(tail) or lengths != {SEGMENT_ROWS}:
            raise CheckpointError(f"{path}: not a segment of this run's iteration log")
        for column, values in part.items():
            log[column].extend(values)
    for column, values in tail.items():
        log[column].extend(values)
    return {**state, "log": log}


def remove_segments(run_dir: Path) -> None:
    """Delete the log segments a previous run left (``--force``): only files named as this
    module names them, and the folder if that empties it."""
    folder = run_dir / LOG_DIR
    if not folder.is_dir():
        return
    for path in folder.glob("rows-[0-9][0-9][0-9][0-9][0-9][0-9].pt"):
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        folder.rmdir()
