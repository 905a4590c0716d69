"""One worker report: what a worker tells about one computation, in one encoding (float64, no
rounding) from the worker to the policy, the iteration log and the trace row.

A synchronous worker writes it under its arrival ticket (``a/<t>/<ticket>``); an asynchronous one
under its global arrival ticket, and under its end key for a computation the run's end cut short.
The engine builds trace rows only from reports (:meth:`WorkerReport.trace_values`); a worker cut
off by a synchronous engine is reported by the engine itself, censored at the cut -- the value the
policy learned from is the value written to the trace, so a model fitted on traces sees exactly
what the live policy saw.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import numpy as np

_FORMAT = struct.Struct("<qqddddq?")
SLOT = 1 + 32  # a report in an all-reduce: its ticket (0: none), then its bytes 2 per float32


class WorkerReport(NamedTuple):
    worker: int  # trace worker 0..N-1
    iteration: int  # the iteration (sync) or the worker's computation index j (async)
    start_s: float  # when the computation began, seconds since run start
    runtime_s: float  # its run-time; if censored, the time at which it was cut off
    loss: float  # training loss of its mini-batch (NaN when it has none)
    delay_s: float  # the injected delay it waited out (or was to wait out)
    version: int = 0  # async: updates applied when the worker read its parameters
    censored: bool = False

    def encode(self) -> bytes:
        return _FORMAT.pack(
            self.worker,
            self.iteration,
            self.start_s,
            self.runtime_s,
            self.loss,
            self.delay_s,
            self.version,
            self.censored,
        )

    @staticmethod
    def decode(blob: bytes) -> WorkerReport:
        w, t, start, runtime, loss, delay, version, censored = _FORMAT.unpack(blob)
        return WorkerReport(w, t, start, runtime, loss, delay, version, censored)

    def to_slot(self, ticket: int) -> np.ndarray:
        """This report as float32 values that survive a sum with zeros exactly (its bytes, two
        at a time, as integers below 2^16), led by its ticket: a collective engine's replicas
        carry their reports in the gradient all-reduce, each in its own slot."""
        raw = self.encode().ljust(2 * (SLOT - 1), b"\0")
        return np.concatenate([[float(ticket)], np.frombuffer(raw, dtype="<u2")]).astype("f4")

    @staticmethod
    def from_slots(values: np.ndarray) -> list[tuple[int, WorkerReport]]:
        """(ticket, report) of every non-empty slot of a reduced slot array, in slot order."""
        out = []
        for row in np.asarray(values, dtype="f4").reshape(-1, SLOT):
            if row[0] > 0:
                raw = row[1:].astype("<u2").tobytes()[: _FORMAT.size]
                out.append((int(row[0]), WorkerReport.decode(raw)))
        return out

    def cut_at(self, runtime_s: float) -> WorkerReport:
        """This computation censored at ``runtime_s`` (no loss: its gradient was not applied)."""
        return self._replace(runtime_s=runtime_s, censored=True, loss=math.nan)

    def trace_values(self) -> dict:
        """The trace row's per-worker columns (schema v1 plus ``injected_delay_s``)."""
        return dict(
            iteration=self.iteration,
            worker=self.worker,
            start_s=max(self.start_s, 0.0),
            runtime_s=max(self.runtime_s, 1e-6),
            censored=self.censored,
            injected_delay_s=self.delay_s,
        )
