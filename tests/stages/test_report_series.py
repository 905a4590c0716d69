"""What the report's pictures must not do: draw two series alike, put two meanings on one x
axis, let one stall flatten the heatmap, promise a line it does not draw, or count an
asynchronous policy's updates as the run's iterations."""

from __future__ import annotations

import numpy as np
import polars as pl
from bdsgd.stages.report import (
    Run,
    make_series,
    nudges,
    plot_cutoff,
    plot_loss,
    robust_range,
    run_iterations,
)

SYNC = ["full", "static:3", "static:2", "elfving", "ecdf", "ewma", "bdsgd", "oracle",
        "bdsgd:fixed", "static:1", "ewma:goodput", "ecdf:online"]  # fmt: skip
ASYNC = ["k-async:3", "async", "adasync"]


def simulate_run(first: int = 240, iterations: int = 60) -> Run:
    """A simulate run: sync policies replayed from iteration ``first``, async ones from 0."""
    frames = []
    for p in SYNC + ASYNC:
        start, n = (0, 3 * iterations) if p in ASYNC else (first, iterations)
        frames.append(pl.DataFrame({
            "policy": [p] * n, "iteration": list(range(start, start + n)), "c": [3] * n,
            "workers": [4] * n, "wall_s": np.arange(1, n + 1) * 0.1, "iteration_s": [0.1] * n,
            "loss": [1.0] * n,
        }))  # fmt: skip
    summary = {"kind": "simulate", "iterations": iterations, "target_loss": 0.5}
    return Run(None, "sim", summary, pl.concat(frames), None)


def test_every_series_has_its_own_colour_and_line_style():
    series = make_series([simulate_run()])
    assert len(series) == 15
    assert len({(s.color, s.linestyle) for s in series}) == 15


def test_sync_and_async_policies_get_their_own_panel_each_from_zero():
    fig = plot_cutoff(make_series([simulate_run()]))
    sync, asyn = fig.axes[0], fig.axes[1]
    assert "update" in asyn.get_xlabel() and "update" not in sync.get_xlabel()
    for ax in (sync, asyn):
        starts = {line.get_xdata()[0] for line in ax.get_lines() if len(line.get_xdata())}
        assert starts == {0.0}  # a replay from 240 and a count of updates from 0, both from 0
    labels = [t.get_text() for t in sync.get_legend().get_texts()]
    assert set(ASYNC).isdisjoint(labels) and set(SYNC) <= set(labels)


def test_equal_values_are_nudged_apart_by_at_most_a_fifth():
    offsets = nudges(12)
    assert len(set(offsets.round(9))) == 12 and np.abs(offsets).max() <= 0.2 + 1e-12


def test_a_stall_does_not_set_the_colour_scale():
    runtimes = np.full(1000, 0.02) + np.random.default_rng(0).normal(0, 0.002, 1000)
    runtimes[500] = 2.4
    low, high = robust_range(runtimes)
    assert high < 0.1 and low > 0.0


def test_the_loss_title_promises_a_dashed_line_only_where_one_is_drawn():
    fig = plot_loss(make_series([simulate_run()]))
    assert "dashed" not in fig.axes[0].get_title() and "did not reach" in fig.axes[0].get_title()


def test_a_simulate_runs_iterations_are_its_summarys_not_the_updates():
    assert run_iterations(simulate_run()) == 60
