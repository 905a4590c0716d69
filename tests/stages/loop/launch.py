"""Start the ranks of a loop script as separate processes (RANK, WORLD_SIZE, MASTER_PORT set,
the store on loopback), each in its own process group, and reap them all: a test never leaves a
rank behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("run_loop.py")
WAIT_S = 240.0  # every rank's whole run, on a loaded machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, *args: str, script: Path = SCRIPT, env: dict | None = None) -> list:
    """Run ``script`` as ``world`` ranks; returns their CompletedProcess-like (rc, output)."""
    port = free_port()
    procs = []
    try:
        for rank in range(world):
            rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world),
                        "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
            procs.append(subprocess.Popen([sys.executable, str(script), *args], env=rank_env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          start_new_session=True, text=True))  # fmt: skip
        outputs = [p.communicate(timeout=WAIT_S)[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outputs, strict=True)]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
