"""Keeping a long run's control store small. Every iteration leaves keys in the store (its
announcement, ticket counter, arrival reports, cut), about 175 bytes each: a run of a million
iterations of 6 workers would hold some 1.7 GB in the process that hosts the store. The engine
hands each recorded iteration's keys to a :class:`KeyJanitor`, which keeps the last
``HIGH_WATER`` iterations' keys and deletes older ones from a background thread over its own
connection, so the deleting costs the engine's loop nothing. No process reads an iteration's keys
that far back: every live worker is within a few iterations of the engine (a synchronous one
joins each iteration; a collective one is announced at most ``LOOKAHEAD`` ahead).

A run shorter than ``HIGH_WATER`` iterations deletes nothing.
"""

from __future__ import annotations

import collections
import threading

import torch.distributed as dist

HIGH_WATER = 2048  # iterations (or asynchronous arrivals) whose keys the store keeps


class KeyJanitor:
    def __init__(self, c10d: dist.Store, high_water: int | None = None):
        self.c10d = c10d
        self.high_water = HIGH_WATER if high_water is None else high_water
        self.pending: collections.deque[list[str]] = collections.deque()
        self.cond = threading.Condition()
        self.closed = False
        self.deleted = 0  # keys deleted so far
        self.thread: threading.Thread | None = None

    def retire(self, keys: list[str]) -> None:
        """The keys of one finished iteration (or arrival), oldest first."""
        with self.cond:
            if self.closed:
                return
            self.pending.append(keys)
            if len(self.pending) > self.high_water:
                self.start()
                self.cond.notify()

    def start(self) -> None:
        """The deleting thread, on first need, with its own store connection."""
        if self.thread is not None:
            return
        try:
            client = self.c10d.clone()
        except (AttributeError, RuntimeError, dist.DistError):
            self.closed = True  # a store without clone: keys stay, as before
            return
        self.thread = threading.Thread(target=self.run, args=(client,), daemon=True,
                                       name="bdsgd-store-janitor")  # fmt: skip
        self.thread.start()

    def run(self, client: dist.Store) -> None:
        while (keys := self.next_batch()) is not None:
            for key in keys:
                try:
                    client.delete_key(key)
                except (RuntimeError, dist.DistError):
                    return  # the store is gone: the run is ending
                self.deleted += 1

    def next_batch(self) -> list[str] | None:
        with self.cond:
            while not self.closed and len(self.pending) <= self.high_water:
                self.cond.wait()
            return None if self.closed else self.pending.popleft()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop deleting (what is left goes with the store at the end of the run)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout_s)
