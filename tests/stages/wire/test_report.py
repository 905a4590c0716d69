"""The one worker report: its encoding keeps every value exactly (float64), and the trace row it
becomes carries those values."""

from __future__ import annotations

import math

from bdsgd.stages.wire.report import WorkerReport


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
