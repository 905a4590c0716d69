"""Start the ranks of a loop script as separate processes (RANK, WORLD_SIZE, MASTER_PORT set,
the store on loopback), each in its own process group, and reap them all: a test never leaves a
rank behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.processes import run_in_sessions

SCRIPT = Path(__file__).with_name("run_loop.py")
WAIT_S = 240.0  # every rank's whole run, on a loaded machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, *args: str, script: Path = SCRIPT, env: dict | None = None) -> list:
    """Run ``script`` as ``world`` ranks; returns their CompletedProcess-like (rc, output)."""
    port = free_port()
    envs = [{**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world),
             "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}  # (as bdsgd's own ranks)
            for rank in range(world)]  # fmt: skip
    ranks = run_in_sessions([[sys.executable, str(script), *args]] * world, timeout=WAIT_S,
                            envs=envs, stderr=subprocess.STDOUT)  # fmt: skip
    return [(rank.returncode, rank.stdout) for rank in ranks]
