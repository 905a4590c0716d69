"""The arrival record's floor: the next gradient pays for itself when it comes soon."""

from __future__ import annotations

import numpy as np
from bdsgd.stages.policies.floor import ArrivalRecord

RATE = 14.0  # gradients per second: a gradient is worth 1 / 14 s = 71 ms


def see(record: ArrivalRecord, arrivals: list[float], cut: float | None = None, n: int = 4):
    """One iteration: ``arrivals`` in, the other workers censored at ``cut`` (the last arrival
    when None)."""
    out = n - len(arrivals)
    runtimes = np.array(arrivals + [cut if cut is not None else arrivals[-1]] * out)
    record.observe(runtimes, np.array([False] * len(arrivals) + [True] * out))


def test_a_gradient_that_comes_a_few_ms_later_pays_one_that_comes_late_does_not():
    record = ArrivalRecord()
    for _ in range(20):
        see(record, [0.155, 0.16, 0.165], cut=0.165)  # the fourth: cut at the arrival, untold
    assert record.pays(1, RATE) and record.pays(2, RATE)
    assert not record.pays(3, RATE)  # nothing known of the fourth
    assert record.floor(4, RATE) == 3 and record.floor(4, RATE, start=3) == 3
    for _ in range(20):
        see(record, [0.155, 0.16, 0.165], cut=0.165 + 0.05)  # still out at the tick: late
    assert not record.pays(3, RATE)


def test_the_record_follows_a_rank_that_becomes_late():
    record = ArrivalRecord()
    for _ in range(30):
        see(record, [0.15, 0.16, 0.165, 0.17])
    assert record.floor(4, RATE) == 4  # every gradient paid
    for _ in range(40):  # the fourth is now a tick late every time, then cut
        see(record, [0.15, 0.16, 0.165], cut=0.215)
    assert record.floor(4, RATE) == 3


def test_a_rare_late_next_gradient_still_pays_a_frequent_one_does_not():
    rare, frequent = ArrivalRecord(), ArrivalRecord()
    rng = np.random.default_rng(0)
    for _ in range(200):
        late = rng.random()
        see(rare, [0.15, 0.16] if late < 0.2 else [0.15, 0.16, 0.165], cut=0.21)
        see(frequent, [0.15, 0.16] if late < 0.7 else [0.15, 0.16, 0.165], cut=0.21)
    # 20% late: 0.8 (1 - 14 x 0.005) - 0.2 x 14 x 0.05 = 0.60 > 0; 70% late: < 0
    assert rare.pays(2, RATE) and not frequent.pays(2, RATE)


def test_no_record_no_floor():
    record = ArrivalRecord()
    assert not record.pays(1, RATE) and record.floor(4, RATE) == 1
    see(record, [0.15, 0.16, 0.17, 0.18])
    assert not record.pays(1, RATE)  # one iteration is not a record
    for _ in range(3):
        see(record, [0.15, 0.16, 0.17, 0.18])
    assert record.pays(1, RATE) and record.floor(4, RATE) == 4
