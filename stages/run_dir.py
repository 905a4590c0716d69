"""A run directory is one run: the files a run writes there, the lock it holds, and the checks
that keep a run from writing over what it did not write.

Every run that writes a run directory (``bdsgd train`` of any policy, a library job with
``out=``) takes :class:`~bdsgd.stages.run_lock.RunDirLock` before it reads or writes anything
there, and holds it to the end. A run started by a launcher that holds the lock already (``bdsgd
train`` spawning its ranks, or running as torchrun's rank 0) finds the directory named in
:data:`LOCKED_ENV` and takes nothing. A new run (not a resume) removes a previous run's files
only once it holds the lock; a refused run changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from bdsgd.stages.errors import ConfigError
from bdsgd.stages.run_lock import LOCK_FILE, RunDirLock

CONFIG_FILE = "config.json"
RUN_FILES = ("summary.json", "iterations.parquet", "checkpoint.pt", "engine_state.pt")
"""What a run leaves besides its config: replaced by a new run in the same directory."""
RUN_DIRS = ("log",)
"""Folders a run writes (the parameter server's iteration-log segments)."""
OURS = frozenset((CONFIG_FILE, LOCK_FILE, *RUN_FILES, *RUN_DIRS))
LOCKED_ENV = "BDSGD_RUN_DIR_LOCKED"
"""The run directory whose lock the launcher of this process holds (an absolute path)."""


JSON_KEYS = {CONFIG_FILE: ("workers", "policy"), "summary.json": ("kind", "run_id")}
"""The keys a run's JSON files hold: a file of that name without them is someone else's."""


def foreign_entries(out: Path) -> list[str]:
    """What ``out`` holds that no bdsgd run wrote (temporary files of an interrupted write
    count as ours)."""
    return sorted(
        p.name
        for p in out.iterdir()
        if not p.name.startswith(".tmp-") and not (p.name in OURS and ours(p))
    )


def ours(path: Path) -> bool:
    """Whether a file named as a run's was written by one (its JSON files hold their keys)."""
    keys = JSON_KEYS.get(path.name)
    if keys is None:
        return True
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(k in data for k in keys)


def check_out(out: Path, flag: str = "out") -> None:
    """A one-line :class:`ConfigError` unless ``out`` is a new path, or a directory holding
    nothing but a bdsgd run's files."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {out} is a file, not a run directory")
    if not out.is_dir():
        return
    try:
        foreign = foreign_entries(out)
    except OSError as exc:
        raise ConfigError(f"cannot read the run directory {out}: {exc.strerror or exc}") from None
    if foreign:
        raise ConfigError(
            f"{flag} {out} holds files bdsgd did not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}): pass a new or empty directory"
        )


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds a run's checkpoint (a run that can be resumed)."""
    return any((out / name).exists() for name in ("checkpoint.pt", "engine_state.pt"))


def clear_run(out: Path) -> None:
    """Remove a previous run's files (never its config, which the new run writes, nor the
    lock); the caller holds the lock."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        shutil.rmtree(out / name, ignore_errors=True)


def locked_by_launcher(out: Path) -> bool:
    """Whether this process's launcher holds ``out``'s lock for it."""
    return os.environ.get(LOCKED_ENV) == str(out.absolute())


def lock_run_dir(out: Path) -> RunDirLock | None:
    """Make ``out`` (a checked path) and take its lock, unless the launcher holds it (None).
    Refused (another run holds it): a one-line :class:`ConfigError`, and a directory this call
    made is removed again."""
    if locked_by_launcher(out):
        return None
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot make the run directory {out}: {exc.strerror or exc}") from None
    try:
        return RunDirLock(out).acquire()
    except ConfigError:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        raise


def open_new_run(out: Path, config: dict, force: bool) -> tuple[RunDirLock, Callable[[], None]]:
    """Take ``out`` for a new run: checked (nothing foreign in it), made, locked, refused unless
    empty (or ``force``: a previous run's files are removed, once the lock is held), and its
    config written. Returns the lock and what undoes the directory (a run that fails before
    its first checkpoint leaves nothing). A refused run changes nothing."""
    check_out(out, "--out")
    created = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    had_lock = (out / LOCK_FILE).exists()

    def refused() -> None:  # as it was: only what this call made goes
        with contextlib.suppress(OSError):
            if not had_lock:
                (out / LOCK_FILE).unlink(missing_ok=True)
            for path in created:
                if path.is_dir() and not any(path.iterdir()):
                    path.rmdir()

    def undo() -> None:  # a run that failed before its first checkpoint
        with contextlib.suppress(OSError):
            clear_run(out)
            (out / CONFIG_FILE).unlink(missing_ok=True)
        refused()

    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = RunDirLock(out).acquire()
    except (ConfigError, OSError) as exc:
        refused()
        if isinstance(exc, OSError):
            raise ConfigError(
                f"cannot make the run directory {out}: {exc.strerror or exc}"
            ) from None
        raise
    try:
        refuse_a_previous_run(out, force)
    except BaseException:
        lock.release()
        refused()
        raise
    try:
        from bdsgd.schemas.run_dir import write_atomic  # (pyarrow: not on the rank side)

        clear_run(out)
        write_atomic(out / CONFIG_FILE, json.dumps(config, indent=2).encode())
    except OSError as exc:
        lock.release()
        undo()
        raise ConfigError(f"cannot write the run directory {out}: {exc.strerror or exc}") from None
    os.environ[LOCKED_ENV] = str(out.absolute())
    return lock, undo


def refuse_a_previous_run(out: Path, force: bool) -> None:
    """Unless ``force``, a directory that holds a previous run's files is refused."""
    names = {
        p.name for p in out.iterdir() if p.name != LOCK_FILE and not p.name.startswith(".tmp-")
    }
    if force or not names:
        return
    if holds_run(out):
        raise ConfigError(
            f"--out {out} already holds a run: pass --resume {out}, another --out, or --force to "
            "start over in it"
        )
    raise ConfigError(
        f"--out {out} holds an earlier run's files ({', '.join(sorted(names))}): pass another "
        "--out, or --force to start over in it"
    )


def open_resumed_run(out: Path) -> RunDirLock:
    """Take the lock of the run directory ``out`` a resumed run continues."""
    lock = RunDirLock(out).acquire()
    os.environ[LOCKED_ENV] = str(out.absolute())
    return lock
