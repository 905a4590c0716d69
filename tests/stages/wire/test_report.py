"""The one worker report: its encoding keeps every value exactly (float64), and the trace row it
becomes carries those values."""

from __future__ import annotations

import math

import numpy as np
from bdsgd.stages.wire.report import SLOT, WorkerReport


def test_a_report_round_trips_at_full_precision():
    report = WorkerReport(7, 123456789012, 1.0 / 3.0, 0.1 + 0.2, 2.0 / 7.0, 1e-9 / 3, 42, False)
    back = WorkerReport.decode(report.encode())
    assert back == report
    assert back.runtime_s == 0.1 + 0.2  # not rounded to 6 or 9 decimals, nor to float32


def test_cut_at_censors_at_the_cut_and_drops_the_loss():
    report = WorkerReport(2, 5, 10.0, 0.5, 1.25, 0.3).cut_at(0.125)
    assert report.censored and report.runtime_s == 0.125 and math.isnan(report.loss)
    assert (report.worker, report.iteration, report.delay_s) == (2, 5, 0.3)


def test_trace_values_carry_the_report():
    values = WorkerReport(3, 9, -0.0001, 0.0, 1.0, 0.25, censored=True).trace_values()
    assert values == dict(
        iteration=9,
        worker=3,
        start_s=0.0,  # clocks of two processes: a start a hair before the origin is the origin
        runtime_s=1e-6,  # run-times are positive
        censored=True,
        injected_delay_s=0.25,
    )


def test_reports_ride_an_all_reduce_exactly():
    """Each replica writes its report in its own slot, zeros elsewhere; the float32 sum of the
    slot arrays gives back every report bit for bit (NaN, -0.0, 1e300 included)."""
    reports = [
        WorkerReport(0, 11, 1.0 / 3.0, 0.1 + 0.2, math.nan, 0.0),
        WorkerReport(2, 11, 1e300, -0.0, -2.5e-7, 5e-324, 3, True),
    ]
    parts = []
    for ticket, report in zip((2, 1), reports, strict=True):
        part = np.zeros((4, SLOT), dtype="f4")
        part[report.worker] = report.to_slot(ticket)
        parts.append(part.ravel())
    reduced = np.sum(parts, axis=0, dtype="f4")
    back = WorkerReport.from_slots(reduced)
    assert [ticket for ticket, _ in back] == [2, 1]  # slot (worker) order, tickets kept
    for (_, got), want in zip(back, reports, strict=True):
        assert got.encode() == want.encode()


def test_an_empty_slot_is_no_report():
    assert WorkerReport.from_slots(np.zeros(3 * SLOT, dtype="f4")) == []
