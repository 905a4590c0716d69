"""What the report's pictures must not do: draw two policies alike, put more than MAX_SERIES
series or two clocks on one panel, let one stall set a scale, nudge a value off its truth,
give heatmap panels scales of their own, say "not reached" of a target never set, or count an
asynchronous policy's updates as the run's iterations."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
import pytest
from bdsgd.stages.report import (
    MAX_SERIES,
    ReportConfig,
    Run,
    load_run,
    make_series,
    plot_cdf,
    plot_cutoff,
    plot_heatmap,
    plot_loss,
    plot_throughput,
    robust_limit,
    robust_range,
    run_iterations,
    run_report,
    series_metrics,
)

from tests.stages.report_demo import STALL_AT, demo_dirs

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
            "loss": [1.0] * n, "decision_ms": [0.01] * n,
        }))  # fmt: skip
    summary = {"kind": "simulate", "iterations": iterations, "target_loss": 0.5}
    return Run(None, "sim", summary, pl.concat(frames), None)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[list[Run], Path]:
    """The demo's three run directories, run-full stalled 30x at iteration 49, and a report."""
    root = tmp_path_factory.mktemp("demo")
    dirs = demo_dirs(root, stall=30.0)
    run_report(ReportConfig(run_dirs=tuple(dirs), out=root / "report"))
    return [load_run(d, []) for d in dirs], root / "report"


def drawn_series(ax: plt.Axes) -> list:
    """The series lines of a panel: neither live workers (light grey), nor reference lines
    (two points: axhline, axvline), nor marks (one point)."""
    return [
        line for line in ax.get_lines() if len(line.get_xdata()) > 2 and line.get_color() != "0.8"
    ]


def test_every_policy_has_its_own_colour_and_keeps_it_across_runs(demo):
    series = make_series([simulate_run()])
    assert len({s.color for s in series}) == 15
    by_policy: dict[str, set] = {}
    for s in make_series(demo[0]):
        by_policy.setdefault(s.policy, set()).add(s.color)
    assert all(len(c) == 1 for c in by_policy.values())  # full, bdsgd: train and replay alike
    assert len({next(iter(c)) for c in by_policy.values()}) == len(by_policy)


def test_no_colour_reused_and_at_most_six_series_a_panel(demo):
    series = make_series(demo[0])
    figures = [plot_cutoff(series), plot_throughput(series, 20), plot_loss(series)]
    figures.append(plot_cutoff(make_series([simulate_run()])))
    for fig in figures:
        for ax in fig.axes:
            colours = [line.get_color() for line in drawn_series(ax)]
            assert len(colours) <= MAX_SERIES, ax.get_title()
            assert len(set(colours)) == len(colours), ax.get_title()
        plt.close(fig)


def test_training_and_replay_seconds_never_share_an_axis(demo):
    fig = plot_throughput(make_series(demo[0]), 20)
    for ax in fig.axes:
        clocks = {"training" in ax.get_xlabel(), "replay" in ax.get_xlabel()}
        assert clocks == {True, False}, ax.get_xlabel()
        runs = {line.get_label() for line in drawn_series(ax)}
        assert not ("full (run-full)" in runs and "full (simulate)" in runs)
    plt.close(fig)


def test_sync_and_async_policies_get_panels_of_their_own_each_from_zero():
    fig = plot_cutoff(make_series([simulate_run()]))
    for ax in fig.axes:
        labels = [t.get_text().split(" (")[0] for t in ax.get_legend().get_texts()]
        is_async = "update" in ax.get_xlabel()
        assert set(labels) - {"live workers"} <= set(ASYNC if is_async else SYNC)
        starts = {line.get_xdata()[0] for line in drawn_series(ax)}
        assert starts == {0.0}  # a replay from 240 and a count of updates from 0, both from 0
    plt.close(fig)


def test_constant_policies_are_drawn_at_their_value_and_live_workers_listed_once(demo):
    series = make_series(demo[0])
    fig = plot_cutoff(series)
    c = {s.label: s.rows["c"].to_numpy() for s in series}
    for ax in fig.axes:
        for line in drawn_series(ax):
            np.testing.assert_array_equal(line.get_ydata(), c[line.get_label().split(" (c =")[0]])
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels.count("live workers") == 1
    assert any("static:3 (c = 3 throughout)" in t.get_text()
               for ax in fig.axes for t in ax.get_legend().get_texts())  # fmt: skip
    plt.close(fig)


def test_a_stall_is_flagged_and_does_not_set_the_scale(demo):
    runs, report = demo
    index = report.joinpath("index.md").read_text()
    assert "## Stalls" in index and f"iteration {STALL_AT} took" in index
    assert "throughput without stalls (gradients/s)" in index
    full = next(s for s in make_series(runs) if s.label == "full (run-full)")
    stall = float(full.rows["iteration_s"].max())
    fig = plot_throughput(make_series(runs), 20)
    top = fig.axes[0].get_ylim()[1]
    assert 1.5 * float(full.rows["iteration_s"].median()) < top < stall / 5
    assert any("off scale" in t.get_text() for t in fig.axes[0].texts)
    cdf = plot_cdf(make_series(runs))
    worst = np.nanmax(runs[0].matrix.runtimes)
    assert cdf.axes[0].get_xlim()[1] < worst / 5
    assert any("beyond the edge" in t.get_text() for t in cdf.axes[0].texts)
    plt.close("all")


def test_heatmap_panels_share_one_colour_scale_and_simulate_shows_its_iterations(demo):
    fig = plot_heatmap(make_series(demo[0]))
    images = [img for ax in fig.axes for img in ax.get_images()]
    assert len(images) == 3 and len({img.get_clim() for img in images}) == 1
    assert images[0].get_clim()[1] < 0.2  # the 30x stall (about 3 s) does not set it
    assert images[2].get_extent()[:2] == [239.5, 299.5]  # iterations 240-299, what it replayed
    assert images[2].get_array().shape == (4, 60)
    plt.close(fig)


def test_time_to_loss_not_reached_only_where_a_target_was_set(demo):
    runs, report = demo
    train = [s for s in make_series(runs) if s.run.summary["kind"] == "train"]
    assert all(series_metrics(s)["time_to_loss"] == "no target" for s in train)
    assert "not reached" not in report.joinpath("index.md").read_text()
    targeted = simulate_run()  # its summary sets target_loss 0.5 and has no time_to_loss
    assert series_metrics(make_series([targeted])[0])["time_to_loss"] == "not reached"


def test_every_metrics_header_has_its_unit(demo):
    index = demo[1].joinpath("index.md").read_text()
    headers = [line for line in index.splitlines() if line.startswith("| policy |")]
    assert headers
    for line in headers:
        cells = [c.strip() for c in line.strip("|").split("|")][1:]
        assert all(re.search(r"\(.+\)", c) for c in cells), line


def test_a_stall_does_not_set_the_colour_scale_or_an_axis_limit():
    runtimes = np.full(1000, 0.02) + np.random.default_rng(0).normal(0, 0.002, 1000)
    runtimes[500] = 2.4
    low, high = robust_range(runtimes)
    assert high < 0.1 and low > 0.0
    assert 0.02 < robust_limit(runtimes) < 0.05


def test_the_loss_title_promises_a_dashed_line_only_where_one_is_drawn():
    fig = plot_loss(make_series([simulate_run()]))
    assert "dashed" not in fig.axes[0].get_title() and "did not reach" in fig.axes[0].get_title()
    plt.close(fig)


def test_a_simulate_runs_iterations_are_its_summarys_not_the_updates():
    assert run_iterations(simulate_run()) == 60
