"""One run per run directory at a time: ``train`` holds an exclusive ``flock`` on the run
directory's :data:`LOCK_FILE` while it runs (a new run from the moment its directory is made, a
resumed one before it reads the checkpoint). The kernel drops the lock with its holder, however
it ends (kill -9 included), so a lock never outlives its run; the file stays (removing it while
another process may be opening it would let two runs hold two different files) and holds the
holder's pid, which a refused run names."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from bdsgd.stages.errors import ConfigError

LOCK_FILE = "run.lock"


class RunDirLock:
    """The lock on ``run_dir`` (which must exist); :meth:`acquire` raises a one-line
    :class:`ConfigError` naming the holder's pid when another process holds it."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> RunDirLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(
                f"cannot lock the run directory: {self.path}: {exc.strerror}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"{self.path.parent} is in use by another run (pid {holder}): one run at a time "
                "per run directory; wait for it to end or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self, remove: bool = False) -> None:
        """Let go (``remove``: and delete the file, for a run directory being undone)."""
        if self.fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            os.close(self.fd)  # (closing drops the flock)
        self.fd = None
