"""One worker report: what a worker tells about one computation, in one encoding (float64, no
rounding) from the worker to the policy, the iteration log and the trace row.

A synchronous worker writes it under its arrival ticket (``a/<t>/<ticket>``); an asynchronous one
under its global arrival ticket, and under its end key for a computation the run's end cut short.
Trace rows are built only from reports (:func:`trace_columns`, the one builder of every path's
rows); a rank cut off in a synchronous iteration is reported by the coordinator itself, censored
at the cut with the delay it was injected -- the value the policy learned from is the value
written to the trace, so a model fitted on traces sees exactly what the live policy saw.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

_FORMAT = struct.Struct("<qqddddq?")


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


def trace_columns(
    reports: list[WorkerReport], hosts: list[str], devices: list[str], **same
) -> dict[str, list]:
    """The trace rows (schema v1 and its extra columns) of ``reports``, column by column:
    ``hosts`` and ``devices`` by worker, ``same`` (run_id, world_size, cutoff, policy, source,
    workload, batch_size) on every row."""
    n = len(reports)
    columns = {k: [v] * n for k, v in same.items()}
    columns["host"] = [hosts[rep.worker] for rep in reports]
    columns["device"] = [devices[rep.worker] for rep in reports]
    values = [rep.trace_values() for rep in reports]
    columns.update({k: [v[k] for v in values] for k in values[0]} if values else {})
    return columns
