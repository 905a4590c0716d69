"""What the collective replicas publish for the coordinator besides their steps: the lowest
replica's state (at each record, and as it stops), the device each computes on, and, as they
stop, each one's parameter digest and join lags and the final held-out loss. Read within bounds:
a replica that does not publish costs one wait, never a hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from bdsgd.stages.engine import protocol as P
from bdsgd.stages.engine.config import EngineConfig


class ReplicaOutputs:
    """The coordinator's collection of what the replicas publish."""

    def __init__(self, c10d: dist.Store, cfg: EngineConfig, alive: Callable[[int], bool]):
        self.c10d, self.cfg, self.alive = c10d, cfg, alive
        self.replica: tuple[int, bytes] | None = None  # (steps, state) last fetched
        self.lags_ms: list[float] = []
        self.digests: dict[int, str] = {}
        self.devices: dict[int, str] = {}  # worker -> the device type it computes on
        self.finished = False  # the replicas were told to stop

    def fetch_state(self, steps: int) -> None:
        """The lowest replica's state after ``steps`` iterations (bounded wait); at the end,
        whatever it published last."""
        if self.finished or (self.replica is not None and self.replica[0] == steps):
            return
        if P.wait_key(self.c10d, P.replica_key(steps), self.cfg.timeout_s):
            self.replica = (steps, self.c10d.get(P.replica_key(steps)))
            self.c10d.delete_key(P.replica_key(steps))  # the store keeps no pile of states

    def parameter_state(self) -> dict:
        if self.replica is None:
            return {}
        return {"replica": torch.frombuffer(bytearray(self.replica[1]), dtype=torch.uint8)}

    def collect(self, started: bool, live: np.ndarray, evals: Callable[[float], None]) -> None:
        """What the replicas publish as they stop, within one bound: a replica that does not
        stop is killed by the launcher after it, so its lateness costs the user one wait.
        ``started``: a generation was announced (stopped during start-up, no replica holds a
        state); ``evals(wait_s)`` collects the held-out losses still due."""
        deadline = time.monotonic() + min(self.cfg.timeout_s, 30.0)

        def left() -> float:
            return max(deadline - time.monotonic(), 0.01)

        if started and self.wait_published(P.replica_key("final"), left):
            blob = self.c10d.get(P.replica_key("final"))
            self.replica = (int(P.decode_replica_state(blob)["steps"]), blob)
        evals(min(1.0, left()))
        for w in map(int, np.flatnonzero(live)):
            # (stopped during start-up: a replica may still be starting, and publishes nothing)
            if self.wait_published(P.digest_key(w), left if started else lambda: 0.0):
                self.digests[w] = self.c10d.get(P.digest_key(w)).decode()
            if self.c10d.check([P.lag_key(w)]):
                blob = self.c10d.get(P.lag_key(w)).decode()
                self.lags_ms += [float(v) for v in blob.split(",") if v]

    def wait_published(self, key: str, left) -> bool:
        """Whether ``key`` appears before ``left()`` runs out, or every worker process is gone
        (a Ctrl-C during start-up can end them before they publish anything)."""
        while not P.wait_key(self.c10d, key, min(0.1, left())):
            if left() <= 0.01 or not any(map(self.alive, range(self.cfg.workers))):
                return self.c10d.check([key])
        return True

    def final_loss(self) -> float | None:
        if self.c10d.check([P.eval_key("final")]):
            return float(self.c10d.get(P.eval_key("final")).decode())
        return None

    def device_of(self, worker: int) -> str:
        """The device ``worker`` reported (set before it counts as ready; read without waiting:
        on a resumed run a worker dead at the checkpoint may count instead of a slow live one,
        which reports by the time it computes). ``--device`` where it has not reported."""
        if worker not in self.devices and self.c10d.check([P.device_key(worker)]):
            self.devices[worker] = self.c10d.get(P.device_key(worker)).decode()
        return self.devices.get(worker, self.cfg.device if self.cfg.device != "auto" else "cpu")

    def summary(self) -> dict:
        """What the run's summary reports of them."""
        lags = np.asarray(self.lags_ms) if self.lags_ms else np.zeros(1)
        return {
            "join_lag_ms_p50": float(np.percentile(lags, 50)),
            "join_lag_ms_p99": float(np.percentile(lags, 99)),
            "replicas_identical": len(set(self.digests.values())) <= 1,
            "replica_digests": {str(k): v for k, v in self.digests.items()},
            "device": ",".join(sorted(set(self.devices.values()))),  # "cpu,cuda": a mix
        }
