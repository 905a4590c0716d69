"""This process's place in a ``torchrun`` launch, read from the variables torchrun sets."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Torchrun:
    """This process's place in a ``torchrun`` launch; the
    control store is torchrun's own (MASTER_ADDR:MASTER_PORT)."""

    rank: int
    world_size: int
    addr: str
    port: int
    agent_store: bool

    @staticmethod
    def from_env() -> Torchrun | None:
        env = os.environ
        if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            return None
        return Torchrun(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
