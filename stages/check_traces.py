"""``bdsgd check-traces DIR [--repair]``: check every file of a trace store as the readers do
(each file's schema and values, at least one row, and what only shows across files: a row two
files hold, a run whose iterations would be a mostly empty matrix) and, with ``repair``, move
each bad file into the store's :data:`QUARANTINE` folder, which readers do not list. Nothing is
deleted or rewritten: a quarantined file can be inspected, fixed, and moved back."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from bdsgd.stages.errors import TraceError
from bdsgd.stages.store import TraceStore

QUARANTINE = "quarantine"


@dataclass(frozen=True, kw_only=True)
class CheckTracesConfig:
    traces: Path
    """The trace store to check."""
    repair: bool = False
    """Move every bad file into ``traces/quarantine/`` (never deletes, never overwrites)."""


@dataclass(frozen=True)
class CheckResult:
    files: int
    """Trace files the store held when checked."""
    rows: int
    """Rows of the good files."""
    bad: dict[Path, str] = field(default_factory=dict)
    """Each bad file and why."""
    moved: dict[Path, Path] = field(default_factory=dict)
    """Each quarantined file and where it went (``repair``)."""


def check_traces(config: CheckTracesConfig) -> CheckResult:
    """Check the store (a store without files is an error); quarantine its bad files if asked."""
    store = TraceStore(config.traces, skip_bad_files=True, quiet=True)
    if not store.path.is_dir():
        raise TraceError(f"no trace store at {store.path}")
    files = store.files()
    rows = store.rows(None, where=str(store.path)).height
    bad = dict(store.problems)
    moved = {f: quarantine(f) for f in bad} if config.repair else {}
    return CheckResult(len(files), rows, bad, moved)


def quarantine(path: Path) -> Path:
    """Move ``path`` into its store's quarantine folder; a file of that name there already is
    an error (nothing is overwritten)."""
    folder = path.parent / QUARANTINE
    target = folder / path.name
    try:
        folder.mkdir(exist_ok=True)
        os.link(path, target)  # (fails where the target exists: no overwrite)
        path.unlink()
    except FileExistsError:
        raise TraceError(f"cannot quarantine {path}: {target} exists already") from None
    except OSError as exc:
        raise TraceError(f"cannot quarantine {path}: {exc.strerror or exc}") from None
    return target
