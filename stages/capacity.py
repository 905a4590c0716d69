"""How many worker processes this machine can run. ``profile`` and ``train`` refuse a worker count
beyond it before any process starts (``--allow-oversubscribe`` overrides): every worker is a
Python process with torch loaded, and thousands spawned at once exhaust the machine before the
first iteration."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from bdsgd.stages.errors import ConfigError

WORKER_BYTES = 320 * 2**20
"""Resident memory to budget per worker: a worker of the built-in mlp holds ~290 MB."""
WORKERS_PER_CORE = 8
"""Workers per core beyond which they mostly wait for a core (they are single-threaded and spend
much of an iteration waiting on delays and on the server)."""


@dataclass(frozen=True)
class Machine:
    cores: int
    """Cores this process may run on."""
    available_bytes: int | None
    """Memory available to new processes (None: unknown)."""

    @staticmethod
    def this() -> Machine:
        return Machine(len(os.sched_getaffinity(0)), available_memory())

    def max_workers(self) -> int:
        by_cores = self.cores * WORKERS_PER_CORE
        if self.available_bytes is None:
            return by_cores
        return max(1, min(by_cores, self.available_bytes // WORKER_BYTES))

    def describe(self) -> str:
        memory = (
            f", {self.available_bytes / 2**30:.1f} GiB available"
            if self.available_bytes is not None
            else ""
        )
        return f"{self.cores} cores{memory}"


def check_capacity(workers: int, allow_oversubscribe: bool, machine: Machine | None = None) -> None:
    """Raise ConfigError when ``workers`` processes are more than ``machine`` (this one by
    default) can run, unless ``allow_oversubscribe``."""
    if allow_oversubscribe:
        return
    machine = machine or Machine.this()
    limit = machine.max_workers()
    if workers > limit:
        raise ConfigError(
            f"--workers {workers} is more than this machine runs ({machine.describe()}: at "
            f"most {limit} workers of ~{WORKER_BYTES // 2**20} MiB); pass --allow-oversubscribe "
            "to start them anyway"
        )


def available_memory(root: Path = Path("/")) -> int | None:
    """MemAvailable of /proc/meminfo, capped by this cgroup's memory.max less its use (cgroup v2);
    None when neither can be read."""
    found = []
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    cgroup = root / "sys/fs/cgroup"
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(0, min(found)) if found else None
