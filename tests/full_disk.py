"""A disk that fills up when a test says so: a small tmpfs where this machine lets the test mount
one (root on Linux), else writes that fail with ENOSPC from then on: torch.save's writes, the
trace store's Parquet writes, and the fsync before every other file's rename."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
from bdsgd.stages import safe_load

FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class Disk:
    """``path`` lives on the disk; :meth:`fill` makes it full (``real``: a tmpfs filled with a
    file, else injected failures); :meth:`free` gives the space back."""

    def __init__(self, path: Path, monkeypatch) -> None:
        self.path, self.monkeypatch = path, monkeypatch
        path.mkdir(parents=True)
        self.real = mount_tmpfs(path, "4m")
        self.full = False
        if not self.real:
            self._inject()

    def fill(self) -> None:
        self.full = True
        if not self.real:
            return
        with open(self.path / "filler", "wb", buffering=0) as fh, contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * 4096)

    def free(self) -> None:
        self.full = False
        (self.path / "filler").unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.real:
            subprocess.run(["umount", "-l", str(self.path)], check=False, timeout=30)

    def _inject(self) -> None:
        disk = self

        def sink_write(sink, data):
            if disk.full and disk.path in Path(sink.fh.name).parents:
                sink.error = FULL
                raise FULL
            return sink.fh.write(data)

        write_table = pq.write_table

        def parquet_write(table, where, *args, **kwargs):
            if disk.full and disk.path in Path(getattr(where, "name", str(where))).parents:
                raise FULL
            return write_table(table, where, *args, **kwargs)

        fsync = os.fsync

        def fsync_full(fd):  # every other file bdsgd writes is fsynced before its rename
            if disk.full and disk.path in Path(os.readlink(f"/proc/self/fd/{fd}")).parents:
                raise FULL
            return fsync(fd)

        self.monkeypatch.setattr(safe_load._Sink, "write", sink_write)
        self.monkeypatch.setattr(pq, "write_table", parquet_write)
        self.monkeypatch.setattr(os, "fsync", fsync_full)


def mount_tmpfs(path: Path, size: str) -> bool:
    """Mount a tmpfs of ``size`` on ``path``; False where this machine does not let us."""
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, timeout=30, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0
