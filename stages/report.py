"""``bdsgd report``: draw what happened in one or more run directories.

A run directory (``schemas/run_dir.py``) holds ``summary.json`` and ``iterations.parquet``; a
train run holds one policy, a simulate run several. Every (run, policy) pair is one *series*. A
panel holds the series of one clock (the training runs, or one simulate run's replay), at most
MAX_SERIES of them (more go to further panels); a policy has one colour in every plot and no two
policies share one. An iteration above STALL_FACTOR times its series' median is a *stall*:
index.md lists it with the series' throughput without it, and the plots draw it beyond the edge
of axes scaled to everything else (``robust_limit``):

    cutoff.png      c and the number of live workers over iterations (asynchronous: updates)
    noise_scale.png c next to the gradient noise scale (runs whose iterations have ``noise_scale``)
    throughput.png  iteration time and rolling throughput (gradients/s) over wall-clock time
    loss.png        training loss vs wall-clock time and vs gradients applied (train runs only)
    heatmap.png     worker x iteration run-times, censored (cut-off) cells marked (needs traces)
    cdf.png         run-time CDF per worker or host, Kaplan-Meier for censoring (needs traces)
    prediction.png  predicted q10-q90 band of the iteration time vs the observed one
    decision_ms.png time to choose c, per policy
    index.md        every written plot with a caption, and the SPEC metrics of every run
    report.json     the marker ``{"kind": "report", ...}``: this directory is a report's

Every file is written under a temporary name and renamed into place; all run directories are read
before anything is written, so a bad input leaves nothing behind. ``--out`` must be new, empty or
an earlier report's (its marker says so): no file report did not write is overwritten.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
import pyarrow as pa  # noqa: E402
from bdsgd.schemas.run_dir import (  # noqa: E402
    check_output_dir,
    iterations_table,
    read_run_dir,
    write_atomic,
)
from bdsgd.stages.errors import BdsgdError, ConfigError  # noqa: E402
from bdsgd.stages.store import RunMatrix, read_trace_path, to_run_matrix  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

INDEX = "index.md"
MARKER = "report.json"  # written first, so a directory holding any report file holds it too
PlotFn = Callable[[list["Series"]], "plt.Figure | None"]
MAX_PANELS = 4  # heatmap, CDF and prediction panels drawn at most
MAX_SERIES = 6  # series per panel at most; more are drawn as small multiples
MAX_CDF_CURVES = MAX_SERIES  # above this many workers, CDFs are drawn per host
STALL_FACTOR = 10.0  # an iteration (run-time) above 10x its series' median is a stall
# Distinct colours, one per policy (tab10 without its grey, which marks live workers, then
# tab20b's dark tones); past their end the colours repeat with another line style.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173",
           "#6b6ecf", "#e7969c", "#b5cf6b")  # fmt: skip
LINESTYLES = ("-", "--", "-.", (0, (1, 1)))
ASYNC_POLICIES = ("async", "adasync", "k-async", "k-batch-sync")


@dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """What to draw and where."""

    run_dirs: tuple[Path, ...]
    """Run directories written by ``bdsgd train --out`` or ``bdsgd simulate --out``."""
    out: Path
    """Directory for the PNG files and ``index.md``: new (created), empty or an earlier report's."""
    rolling_window: int = 20
    """Iterations in the rolling window of the throughput curve."""
    dpi: int = 100
    """Resolution of the PNG files."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_dirs", tuple(Path(p) for p in self.run_dirs))
        object.__setattr__(self, "out", Path(self.out))
        if not self.run_dirs:
            raise ConfigError("report needs at least one run directory")
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"--out {self.out} exists and is not a directory")
        if self.rolling_window < 1:
            raise ConfigError(f"rolling_window must be >= 1, got {self.rolling_window}")
        if self.dpi < 10:
            raise ConfigError(f"dpi must be >= 10, got {self.dpi}")


@dataclass(frozen=True)
class ReportResult:
    """What ``run_report`` wrote."""

    index: Path
    plots: tuple[Path, ...]
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Run:
    """One run directory, read."""

    path: Path
    name: str
    summary: dict
    iterations: pl.DataFrame
    matrix: RunMatrix | None  # the run's worker traces, when they could be read


@dataclass(frozen=True)
class Series:
    """One policy of one run: the unit every plot draws."""

    label: str
    run: Run
    policy: str
    rows: pl.DataFrame = field(repr=False)
    color: str = "C0"  # the same in every plot
    linestyle: str | tuple = "-"  # with the colour, tells more than 10 series apart

    @property
    def style(self) -> dict:
        return {"color": self.color, "ls": self.linestyle}

    @property
    def asynchronous(self) -> bool:
        """An asynchronous policy's iterations are updates (k-async, async, adasync)."""
        return self.policy.split(":")[0] in ASYNC_POLICIES

    def steps(self) -> np.ndarray:
        """The x of a per-iteration plot: iterations (updates) since the series' first, so a
        simulate replay that began at iteration 240 and a train run from 0 share one axis."""
        it = _values(self, "iteration")
        return it - it[0] if it.size else it


# -- reading ----------------------------------------------------------------------------------
def load_run(path: Path, warnings: list[str]) -> Run:
    """Read a run directory and, if reachable, the worker traces it points to. A train run that
    was killed (no summary.json yet) is read from its last checkpoint, with a warning."""
    try:
        summary, table = read_run_dir(path)
    except BdsgdError:
        if not any((path / name).is_file() for name in CHECKPOINTS):
            raise
        summary, table = killed_run(path)
        warnings.append(
            f"{path}: a train run that did not finish (no summary.json): its "
            f"{table.num_rows} iterations up to its last checkpoint are reported"
        )
    rows = pl.from_arrow(table)  # policies keep the order the run wrote them in
    name = path.resolve().name or str(path)
    return Run(path, name, summary, rows, _load_matrix(path, summary, warnings))


CHECKPOINTS = ("engine_state.pt", "server_state.pt")  # (bdsgd.stages.engine.resume's names)


def killed_run(path: Path) -> tuple[dict, pa.Table]:
    """A killed train run's summary (what its config says) and iteration log (its checkpoint's,
    read with ``weights_only``)."""
    from bdsgd.stages.train import CONFIG_FILE, load_state  # (torch: only for a killed run)

    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    state = load_state(path)
    table = iterations_table(state["log"]) if state["log"].get("iteration") else None
    if table is None:
        raise BdsgdError(f"{path}: the run has no iterations")
    summary = {"kind": "train", "run_id": state.get("run_id"), "interrupted": True}
    summary |= {k: config[k] for k in ("traces", "policy", "target_loss") if k in config}
    return summary, table


def _load_matrix(path: Path, summary: dict, warnings: list[str]) -> RunMatrix | None:
    traces = summary.get("traces")
    if not traces:
        warnings.append(f"{path}: summary names no trace store; heatmap and CDF skipped")
        return None
    store = Path(traces)
    if not store.exists() and not store.is_absolute():
        store = path / store
    try:
        df = read_trace_path(store)
    except (BdsgdError, OSError) as exc:
        warnings.append(f"{path}: traces unreadable ({exc}); heatmap and CDF skipped")
        return None
    run_id = summary.get("run_id") or (sorted(df["run_id"].unique())[0] if df.height else None)
    df = df.filter(pl.col("run_id") == run_id) if run_id is not None else df
    if df.height == 0:
        warnings.append(f"{path}: no trace rows for run {run_id!r}; heatmap and CDF skipped")
        return None
    return to_run_matrix(df)


def make_series(runs: list[Run]) -> list[Series]:
    """One series per (run, policy); the run's name joins the label when a policy repeats. A
    policy keeps one colour in every plot, and no two policies share one (``policy_colours``)."""
    pairs = [(run, p) for run in runs for p in run.iterations["policy"].unique(maintain_order=True)]
    counts: dict[str, int] = {}
    for _, p in pairs:
        counts[p] = counts.get(p, 0) + 1
    colours = policy_colours([p for _, p in pairs])
    return [
        Series(
            label=p if counts[p] == 1 else f"{p} ({run.name})",
            run=run,
            policy=p,
            rows=run.iterations.filter(pl.col("policy") == p).sort("iteration"),
            color=colours[p][0],
            linestyle=colours[p][1],
        )
        for run, p in pairs
    ]


def policy_colours(policies: list[str]) -> dict[str, tuple[str, str | tuple]]:
    """Colour and line style per policy, in order of first appearance: PALETTE's colours, then
    (past its end) the same colours again with another line style."""
    names = list(dict.fromkeys(policies))
    return {
        p: (PALETTE[i % len(PALETTE)], LINESTYLES[i // len(PALETTE) % len(LINESTYLES)])
        for i, p in enumerate(names)
    }


def is_replay(run: Run) -> bool:
    """Whether the run is a simulate replay (its seconds are replayed, not trained)."""
    return run.summary.get("kind") == "simulate"


@dataclass(frozen=True)
class Panel:
    """Series drawn on one panel: one clock (training or replay seconds), one kind of step
    (iterations, or updates for asynchronous policies), at most MAX_SERIES of them."""

    title: str
    series: tuple[Series, ...]
    replay: bool
    updates: bool

    @property
    def clock(self) -> str:
        return "replay" if self.replay else "training"


def panels(series: list[Series], split_async: bool = False) -> list[Panel]:
    """The panels of a plot: training runs together, each simulate run apart (its seconds are
    replayed, not trained), asynchronous policies apart when ``split_async``, and each group
    cut into chunks of at most MAX_SERIES series (small multiples)."""
    groups: dict[tuple, list[Series]] = {}
    for s in series:
        key = (is_replay(s.run) and id(s.run), split_async and s.asynchronous)
        groups.setdefault(key, []).append(s)
    out: list[Panel] = []
    for group in groups.values():
        first = group[0]
        updates = split_async and first.asynchronous
        title = replay_name(first.run) if is_replay(first.run) else "training runs"
        title += ", asynchronous and batch policies" if updates else ""
        chunks = [group[i : i + MAX_SERIES] for i in range(0, len(group), MAX_SERIES)]
        for k, chunk in enumerate(chunks):
            part = f" ({k + 1}/{len(chunks)})" if len(chunks) > 1 else ""
            out.append(Panel(title + part, tuple(chunk), is_replay(first.run), updates))
    return out


def replay_name(run: Run) -> str:
    """A simulate run's name in a title."""
    return "simulate replay" if run.name == "simulate" else f"{run.name} (simulate replay)"


# -- stalls and robust axis limits ------------------------------------------------------------
def stall_mask(values: np.ndarray, factor: float = STALL_FACTOR) -> np.ndarray:
    """True where a value is more than ``factor`` times the median of the finite values."""
    finite = np.isfinite(values)
    if not finite.any():
        return np.zeros(values.shape, dtype=bool)
    median = float(np.median(values[finite]))
    with np.errstate(invalid="ignore"):
        return finite & (median > 0) & (values > factor * median)


def robust_limit(values: np.ndarray) -> float:
    """An axis's upper limit: 10% above the largest value that is not a stall, so that one
    stall (drawn beyond the edge, marked) does not flatten everything else."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    kept = values[~stall_mask(values)]
    top = float(kept.max()) if kept.size else 0.0
    return top * 1.1 if top > 0 else 1.0


def mark_beyond(ax: plt.Axes, x: np.ndarray, y: np.ndarray, limit: float, color: str) -> int:
    """Mark the points above ``limit`` (beyond the axis's top edge) with a triangle at the edge
    and their value; returns how many there are."""
    beyond = np.isfinite(y) & (y > limit)
    for xi, yi in zip(x[beyond], y[beyond], strict=True):
        ax.plot([xi], [limit], marker="^", ms=9, color=color, mec="black", clip_on=False, zorder=9)
        ax.annotate(f"{yi:.3g} s, off scale", (xi, limit), xytext=(6, -12), fontsize="small",
                    textcoords="offset points", color="black", zorder=9)  # fmt: skip
    return int(beyond.sum())


def shade_stalls(axes: tuple[plt.Axes, ...], s: Series) -> None:
    """Shade, in the series' colour, the wall-clock span of each of its stalls."""
    wall, secs = _values(s, "wall_s"), _values(s, "iteration_s")
    for i in np.nonzero(stall_mask(secs))[0]:
        for ax in axes:
            ax.axvspan(wall[i] - secs[i], wall[i], color=s.color, alpha=0.12, lw=0)


@dataclass(frozen=True)
class Stall:
    """One iteration of a series more than STALL_FACTOR times the series' median."""

    series: Series
    iteration: int
    seconds: float
    median: float


def find_stalls(s: Series) -> list[Stall]:
    """The series' stalls, in iteration order."""
    secs = _values(s, "iteration_s")
    median = float(np.nanmedian(secs)) if np.isfinite(secs).any() else 0.0
    its = s.rows["iteration"].to_numpy()
    return [Stall(s, int(its[i]), float(secs[i]), median) for i in np.nonzero(stall_mask(secs))[0]]


def _values(s: Series, column: str) -> np.ndarray:
    """A column as floats, nulls as NaN."""
    return s.rows[column].cast(pl.Float64).fill_null(float("nan")).to_numpy()


def has_values(s: Series, column: str) -> bool:
    """Whether the series has the column (older run directories may lack newer ones) with at
    least one value."""
    return column in s.rows.columns and s.rows[column].null_count() < s.rows.height


def rolling_throughput(c: np.ndarray, seconds: np.ndarray, window: int) -> np.ndarray:
    """Gradients per second over the last ``window`` iterations."""
    cc, cs = np.cumsum(c, dtype=float), np.cumsum(seconds, dtype=float)
    lag_c = (
        np.concatenate([np.zeros(window), cc[:-window]]) if window < len(cc) else np.zeros_like(cc)
    )
    lag_s = (
        np.concatenate([np.zeros(window), cs[:-window]]) if window < len(cs) else np.zeros_like(cs)
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        return (cc - lag_c) / (cs - lag_s)


def kaplan_meier(times: np.ndarray, censored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kaplan-Meier CDF F(t) = 1 - S(t) at each distinct finished run-time. A censored entry
    (real run-time >= the value) stays at risk up to its value, then leaves without an event:
    the right treatment of cut-off stragglers, unlike dropping them or reading them as finished."""
    order = np.argsort(times, kind="stable")
    times, censored = times[order], censored[order]
    at_risk = len(times) - np.arange(len(times))
    factors = np.where(censored, 1.0, 1.0 - 1.0 / at_risk)
    survival = np.cumprod(factors)
    finished = ~censored
    return times[finished], 1.0 - survival[finished]


# -- plots: each takes the series (or runs) and returns a figure, or None when nothing applies --
def _legend_outside(ax: plt.Axes) -> None:
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _grid(rows: int, cols: int, width: float, row_height: float, **kw) -> tuple:
    """A figure of rows x cols panels laid out by matplotlib's constrained layout."""
    size = (width, 0.8 + row_height * rows)
    return plt.subplots(rows, cols, figsize=size, squeeze=False, layout="constrained", **kw)


def _steps_label(panel: Panel) -> str:
    kind = "update" if panel.updates else "iteration"
    return f"{kind} (from the {'replay' if panel.replay else 'run'}'s first)"


def layered_widths(n: int) -> np.ndarray:
    """Line widths from 4.5 (drawn first, underneath) down to 1.0 (on top): series with equal
    values show as nested stripes instead of hiding one another."""
    return np.linspace(4.5, 1.0, n) if n > 1 else np.array([1.4])


def plot_cutoff(series: list[Series]) -> plt.Figure:
    """c per iteration, one panel per clock and kind of step, at most MAX_SERIES series each; a
    constant policy's legend entry gives its value; live workers once per panel, grey behind."""
    groups = panels(series, split_async=True)
    fig, axes = _grid(len(groups), 1, 11, 3.0)
    top = max(int(np.nanmax(_values(s, "workers"))) for s in series)
    for ax, panel in zip(axes[:, 0], groups, strict=True):
        _live_workers(ax, panel.series)
        for k, (s, lw) in enumerate(zip(panel.series, layered_widths(len(panel.series)),
                                        strict=True)):  # fmt: skip
            c = _values(s, "c")
            const = f" (c = {c[0]:g} throughout)" if c.size and np.all(c == c[0]) else ""
            ax.step(s.steps(), c, where="post", lw=lw, label=s.label + const, zorder=2 + k,
                    **s.style)  # fmt: skip
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(-0.2, top + 0.5)
        what = "updates" if panel.updates else "iterations"
        ax.set(xlabel=_steps_label(panel), ylabel="c (gradients applied)",
               title=f"Cutoff c per {what[:-1]}: {panel.title}")  # fmt: skip
        _legend_outside(ax)
    return fig


def _live_workers(ax: plt.Axes, group: tuple[Series, ...]) -> None:
    """The live workers of the runs in ``group``, a wide light-grey step behind the series:
    each distinct curve drawn once, "live workers" once in the legend."""
    drawn: list[tuple[np.ndarray, np.ndarray]] = []
    for run in {id(s.run): s.run for s in group}.values():
        s = max((x for x in group if x.run is run), key=lambda x: x.rows.height)
        x, y = s.steps(), _values(s, "workers")
        if any(np.array_equal(x, a) and np.array_equal(y, b) for a, b in drawn):
            continue
        ax.step(x, y, where="post", lw=6.0, color="0.8", zorder=1,
                label="live workers" if not drawn else None)  # fmt: skip
        drawn.append((x, y))


def plot_noise_scale(series: list[Series]) -> plt.Figure | None:
    """Per panel of series: c (upper) and the gradient noise scale B (lower, samples, log
    scale), both per iteration."""
    noisy = [s for s in series if has_values(s, "noise_scale")]
    if not noisy:
        return None
    groups = panels(noisy, split_async=True)
    fig, axes = _grid(2 * len(groups), 1, 11, 2.4)
    for k, panel in enumerate(groups):
        top, bottom = axes[2 * k, 0], axes[2 * k + 1, 0]
        widths = layered_widths(len(panel.series))
        for s, lw in zip(panel.series, widths, strict=True):
            it, noise = s.steps(), _values(s, "noise_scale")
            top.step(it, _values(s, "c"), where="post", lw=lw, label=s.label, **s.style)
            bottom.plot(it, np.where(np.isfinite(noise), noise, np.nan), lw=lw, **s.style)
        step = "update" if panel.updates else "iteration"
        top.yaxis.set_major_locator(MaxNLocator(integer=True))
        top.set(ylabel="c (gradients)", title=f"Cutoff c per {step}: {panel.title}")
        bottom.set(xlabel=_steps_label(panel), ylabel="noise scale B (samples)", yscale="log",
                   title=f"Gradient noise scale B per {step}: {panel.title}")  # fmt: skip
        bottom.sharex(top)
        _legend_outside(top)
    return fig


def plot_throughput(series: list[Series], window: int) -> plt.Figure:
    """Per panel (one clock, at most MAX_SERIES series): iteration time (left) and rolling
    throughput (right) over that clock's seconds. Stalls are drawn beyond the top edge of the
    iteration-time axis, marked with their value; neither axis is scaled by them."""
    groups = panels(series)
    secs = {id(s): _values(s, "iteration_s") for s in series}
    rates = {id(s): rolling_throughput(_values(s, "c"), secs[id(s)], window) for s in series}
    time_top = robust_limit(np.concatenate(list(secs.values())))
    rate_top = robust_limit(np.concatenate(list(rates.values())))
    fig, axes = _grid(len(groups), 2, 14, 3.0)
    for (left, right), panel in zip(axes, groups, strict=True):
        for s in panel.series:
            wall = _values(s, "wall_s")
            left.step(wall, secs[id(s)], where="pre", lw=0.9, **s.style)
            right.plot(wall, rates[id(s)], lw=1.1, label=s.label, **s.style)
            mark_beyond(left, wall - secs[id(s)] / 2, secs[id(s)], time_top, s.color)
            shade_stalls((left, right), s)
        xlabel = f"{panel.clock} wall-clock time (s)"
        left.set(xlabel=xlabel, ylabel="iteration time (s)", ylim=(0, time_top))
        left.set_title(f"Iteration time: {panel.title}", pad=14)  # (above the stall marks)
        right.set(xlabel=xlabel, ylabel=f"gradients/s (rolling {window} iterations)",
                  ylim=(0, rate_top), title=f"Throughput: {panel.title}")  # fmt: skip
        _legend_outside(right)
    return fig


def plot_loss(series: list[Series]) -> plt.Figure | None:
    """Per panel (one clock, at most MAX_SERIES series): loss vs seconds and vs gradients."""
    with_loss = [s for s in series if has_values(s, "loss")]
    if not with_loss:
        return None
    target = next((s.run.summary.get("target_loss") for s in with_loss
                   if s.run.summary.get("target_loss") is not None), None)  # fmt: skip
    groups = panels(with_loss)
    fig, axes = _grid(len(groups), 2, 13, 3.4, sharey=True)
    for (by_time, by_grads), panel in zip(axes, groups, strict=True):
        reached = 0  # series whose time_to_loss is drawn (a dashed line)
        for s in panel.series:
            loss = _values(s, "loss")
            by_time.plot(_values(s, "wall_s"), loss, lw=0.8, **s.style)
            shade_stalls((by_time,), s)
            by_grads.plot(np.cumsum(_values(s, "c")), loss, lw=0.8, label=s.label, **s.style)
            ttl = _summary_for(s).get("time_to_loss")
            if isinstance(ttl, (int, float)) and np.isfinite(ttl):
                by_time.axvline(ttl, ls="--", color=s.color, lw=0.8)
                reached += 1
        if isinstance(target, (int, float)):
            by_grads.axhline(target, color="grey", ls=":", lw=0.8, label="target loss")
            by_time.axhline(target, color="grey", ls=":", lw=0.8)
        by_time.set(xlabel=f"{panel.clock} wall-clock time (s)", ylabel="training loss",
                    title=_loss_title(reached, isinstance(target, (int, float))) + ": "
                    + panel.title)  # fmt: skip
        by_grads.set(xlabel="gradients applied (cumulative c)",
                     title=f"Loss vs gradients applied: {panel.title}")  # fmt: skip
        _legend_outside(by_grads)
    return fig


def _loss_title(reached: int, has_target: bool) -> str:
    """The title says what the dashed lines are, and only when one is drawn."""
    if reached:
        return "Loss vs time (dashed: time_to_loss, the smoothed loss first at the target)"
    if has_target:
        return "Loss vs time (the smoothed loss did not reach the target)"
    return "Loss vs time"


def _runs_with_traces(series: list[Series]) -> list[Run]:
    runs: list[Run] = []
    for s in series:
        if s.run.matrix is not None and all(r is not s.run for r in runs):
            runs.append(s.run)
    return runs[:MAX_PANELS]


def trace_window(run: Run) -> tuple[int, int]:
    """The iterations of the run's traces the run used: a simulate run's replayed ones
    (``from_iteration`` on, ``iterations`` of them), a train run's all."""
    total = run.matrix.shape[0]
    if not is_replay(run):
        return 0, total
    start = run.summary.get("from_iteration")
    start = start if isinstance(start, int) and 0 <= start < total else 0
    count = run.summary.get("iterations")
    stop = start + count if isinstance(count, int) and count > 0 else total
    return start, min(stop, total)


def windowed(run: Run) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The run's run-times, censoring and presence over its ``trace_window``, and its start."""
    m, (a, b) = run.matrix, trace_window(run)
    return m.runtimes[a:b], m.censored[a:b], m.present[a:b], a


def plot_heatmap(series: list[Series]) -> plt.Figure | None:
    """Worker x iteration run-times over the iterations each run used, every panel on one
    colour scale (``robust_range`` of all panels' run-times); stalls starred."""
    runs = _runs_with_traces(series)
    if not runs:
        return None
    data = [windowed(run) for run in runs]
    low, high = robust_range(np.concatenate([rt[pr] for rt, _, pr, _ in data]))
    fig, axes = _grid(len(runs), 1, 11, 2.2)
    for ax, run, (rt, cen, pr, a) in zip(axes[:, 0], runs, data, strict=True):
        img = ax.imshow(np.where(pr, rt, np.nan).T, aspect="auto", interpolation="nearest",
                        origin="lower", cmap="viridis", vmin=low, vmax=high,
                        extent=(a - 0.5, a + rt.shape[0] - 0.5, -0.5, rt.shape[1] - 0.5))  # fmt: skip
        it, wk = np.nonzero(cen & pr)
        size = 30 if rt.shape[0] <= 100 else 6  # crosses must not hide a long run
        ax.scatter(it + a, wk, marker="x", s=size, color="red", lw=0.8, label="censored (cut off)")
        st, sw = np.nonzero(stall_mask(np.where(pr, rt, np.nan)))
        if len(st):
            ax.scatter(st + a, sw, marker="*", s=140, color="magenta", edgecolor="white",
                       lw=0.5, label=f"stall (> {STALL_FACTOR:g}x median)")  # fmt: skip
        used = " (the iterations simulate replayed)" if is_replay(run) else ""
        ax.set(xlabel="iteration", ylabel="worker",
               title=f"Run-times, {run.name} ({run.matrix.run_id}){used}")  # fmt: skip
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if len(it) or len(st):
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.colorbar(img, ax=axes[:, 0].tolist(), extend="both",
                 label="run-time (s); one scale for all panels")  # fmt: skip
    return fig


def robust_range(values: np.ndarray) -> tuple[float, float]:
    """The colour scale of a heatmap: the 1st to 99th percentile of the run-times, so that one
    stall (a 2.4 s iteration among 20 ms ones) does not flatten every other cell; cells beyond
    take the end colours."""
    values = values[np.isfinite(values)]
    if values.size == 0:
        return 0.0, 1.0
    low, high = np.percentile(values, [1, 99])
    return float(low), float(max(high, low + 1e-9))


def _cdf_groups(m: RunMatrix) -> dict[str, np.ndarray]:
    """Worker columns to pool per curve: one per worker, one per host when there are more than
    MAX_CDF_CURVES workers, and all pooled when there are more hosts than that too."""
    n = m.shape[1]
    if n <= MAX_CDF_CURVES:
        return {f"worker {w}": np.array([w]) for w in range(n)}
    hosts = np.array(m.hosts)
    if len(set(m.hosts)) <= MAX_CDF_CURVES:
        return {f"host {h}": np.nonzero(hosts == h)[0] for h in dict.fromkeys(m.hosts)}
    return {f"all {n} workers": np.arange(n)}


def plot_cdf(series: list[Series]) -> plt.Figure | None:
    """Kaplan-Meier run-time CDFs per worker (host) over the iterations each run used; one
    x scale for all panels (``robust_limit``), run-times beyond it marked at the edge."""
    runs = _runs_with_traces(series)
    if not runs:
        return None
    data = [windowed(run) for run in runs]
    right = robust_limit(np.concatenate([rt[pr] for rt, _, pr, _ in data]))
    fig, axes = _grid(1, len(runs), 5.2 * len(runs), 3.6, sharey=True)
    for ax, run, (rt, cen, pr, _) in zip(axes[0], runs, data, strict=True):
        beyond: list[float] = []
        for k, (label, cols) in enumerate(_cdf_groups(run.matrix).items()):
            keep = pr[:, cols]
            t, f = kaplan_meier(rt[:, cols][keep], cen[:, cols][keep])
            if not len(t):
                continue
            color = PALETTE[k % len(PALETTE)]
            ax.step(t, f, where="post", lw=1.1, color=color, label=label)
            if t[-1] > right:
                edge = f[t <= right][-1] if (t <= right).any() else 0.0
                ax.plot([right], [edge], marker=">", ms=9, color=color, mec="black",
                        clip_on=False, zorder=9)  # fmt: skip
                beyond += [float(x) for x in t[t > right]]
        if beyond:
            ax.annotate(f"beyond the edge: {', '.join(f'{x:.3g}' for x in beyond[:4])} s",
                        (0.98, 0.04), xycoords="axes fraction", ha="right", fontsize="small")  # fmt: skip
        used = ", replayed iterations" if is_replay(run) else ""
        ax.set(xlabel="run-time (s)", ylabel="P(run-time <= x)", xlim=(0, right),
               title=f"Run-time CDF, {run.name}{used}")  # fmt: skip
        ax.legend(fontsize="x-small", loc="center right")
    return fig


def plot_prediction(series: list[Series]) -> plt.Figure | None:
    """Per series with a prediction: the q10-q90 band and median vs the observed iteration
    time; the y axis is not scaled by stalls (marked at the edge)."""
    predicted = [s for s in series if has_values(s, "pred_q50")][:MAX_PANELS]
    if not predicted:
        return None
    fig, axes = _grid(len(predicted), 1, 10, 2.4)
    for ax, s in zip(axes[:, 0], predicted, strict=True):
        it, actual = s.steps(), _values(s, "iteration_s")
        lo, mid, hi = _values(s, "pred_q10"), _values(s, "pred_q50"), _values(s, "pred_q90")
        ax.fill_between(it, lo, hi, alpha=0.3, color=s.color, step="mid", label="predicted q10-q90")
        ax.plot(it, mid, lw=0.8, color=s.color, label="predicted median")
        ax.plot(it, actual, ".", ms=3, color="black", label="observed")
        top = robust_limit(np.concatenate([actual, hi]))
        mark_beyond(ax, it, actual, top, "black")
        known = np.isfinite(lo) & np.isfinite(hi)
        coverage = np.mean((actual[known] >= lo[known]) & (actual[known] <= hi[known]))
        ax.set(xlabel=f"iteration (from the {'replay' if is_replay(s.run) else 'run'}'s first)",
               ylabel="iteration time (s)", ylim=(0, top))  # fmt: skip
        ax.set_title(f"{s.label}: observed inside q10-q90 {coverage:.0%} of iterations "
                     "(ideal 80%)", pad=14)  # fmt: skip
        _legend_outside(ax)
    return fig


def plot_decision_ms(series: list[Series]) -> plt.Figure:
    """A box of the time to choose c per series, each in its policy's colour."""
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(series)), 4.2), layout="constrained")
    data = [_values(s, "decision_ms") for s in series]
    boxes = ax.boxplot(data, showfliers=True, patch_artist=True, medianprops={"color": "black"})
    for box, s in zip(boxes["boxes"], series, strict=True):
        box.set(facecolor=s.color, alpha=0.6)
    ax.set_xticks(range(1, len(series) + 1), [s.label for s in series], rotation=30,
                  ha="right", fontsize="small")  # fmt: skip
    if all(np.all(d > 0) for d in data):
        ax.set_yscale("log")
    ax.set(ylabel="decision time (ms)", title="Time to choose c per iteration")
    return fig


# -- metrics and index ------------------------------------------------------------------------
METRICS = (
    "throughput",
    "goodput",
    "oracle_ratio",
    "mean_c",
    "time_to_loss",
    "decision_ms_p50",
    "decision_ms_p99",
    "idle_fraction",
)
OPTIONAL_METRICS = ("oracle_ratio", "idle_fraction", "goodput")  # shown when some run has them
HEADERS = {
    "throughput": "throughput (gradients/s)",
    "goodput": "goodput (one-worker steps/s)",
    "oracle_ratio": "oracle_ratio (x oracle)",
    "mean_c": "mean_c (gradients)",
    "time_to_loss": "time_to_loss (s)",
    "decision_ms_p50": "decision_ms_p50 (ms)",
    "decision_ms_p99": "decision_ms_p99 (ms)",
    "idle_fraction": "idle_fraction (share of worker-s)",
    "without_stalls": "throughput without stalls (gradients/s)",
}


def series_metrics(s: Series) -> dict[str, float | str | None]:
    """The SPEC metrics of one series: the run's summary where it states them, else computed
    from its iterations (throughput = sum c / sum iteration time; decision_ms percentiles).
    time_to_loss reads "not reached" only where a target loss was set, "no target" where a
    loss was logged without one."""
    c, secs, dms = _values(s, "c"), _values(s, "iteration_s"), _values(s, "decision_ms")
    gains = _values(s, "gain") if has_values(s, "gain") else None
    computed = {
        "throughput": float(c.sum() / secs.sum()) if secs.sum() > 0 else None,
        "goodput": float(np.nansum(gains) / secs.sum()) if gains is not None else None,
        "mean_c": float(c.mean()),
        "decision_ms_p50": float(np.percentile(dms, 50)),
        "decision_ms_p99": float(np.percentile(dms, 99)),
    }
    given = _summary_for(s)
    metrics = {name: given.get(name, computed.get(name)) for name in METRICS}
    if metrics["time_to_loss"] is None and has_values(s, "loss"):
        has_target = s.run.summary.get("target_loss") is not None
        metrics["time_to_loss"] = "not reached" if has_target else "no target"
    kept = ~stall_mask(secs)
    if not kept.all() and secs[kept].sum() > 0:
        metrics["without_stalls"] = float(c[kept].sum() / secs[kept].sum())
    return metrics


def _summary_for(s: Series) -> dict:
    summary = s.run.summary
    policies = summary.get("policies")
    if isinstance(policies, dict):
        return policies.get(s.policy, {})
    return summary if summary.get("policy") in (None, s.policy) else {}


def _fmt(value: float | str | None) -> str:
    if value is None:
        return "–"
    if isinstance(value, (int, float)):
        return f"{value:.4g}"
    return str(value)


def metrics_table(series: list[Series], shown: tuple[str, ...]) -> list[str]:
    """One Markdown row per series, every header with its unit."""
    heads = ["policy"] + [HEADERS[k] for k in shown]
    lines = ["| " + " | ".join(heads) + " |", "|---" * len(heads) + "|"]
    for s in series:
        m = series_metrics(s)
        lines.append(f"| {s.policy} | " + " | ".join(_fmt(m.get(k)) for k in shown) + " |")
    return lines


def stall_lines(series: list[Series]) -> list[str]:
    """The stalls section: each iteration above STALL_FACTOR times its series' median, its
    share of the run's time, and the series' throughput with and without its stalls."""
    found = [(s, st) for s in series if (st := find_stalls(s))]
    if not found:
        return []
    lines = ["## Stalls", "",
             f"Iterations more than {STALL_FACTOR:g}x their series' median time. Each is drawn "
             "beyond the top edge of throughput.png's and prediction.png's axes (a triangle "
             "with its value) and does not set their scale; the throughput figures below "
             "include it unless said.", ""]  # fmt: skip
    for s, stalls in found:
        secs, c = _values(s, "iteration_s"), _values(s, "c")
        kept = ~stall_mask(secs)
        total = float(np.nansum(secs))
        with_, without = c.sum() / total, c[kept].sum() / secs[kept].sum()
        for st in stalls:
            lines.append(f"- **`{s.run.name}` {s.policy}: iteration {st.iteration} took "
                         f"{st.seconds:.3f} s, {st.seconds / st.median:.0f}x the median "
                         f"{st.median:.3f} s**, {st.seconds / total:.0%} of the "
                         f"{total:.2f} s of all its iterations")  # fmt: skip
        lines.append(f"  - throughput {with_:.4g} gradients/s with its stalls, "
                     f"{without:.4g} without")  # fmt: skip
    return lines + [""]


def run_iterations(run: Run) -> int:
    """The iterations a run ran (or replayed): its summary's count, else the most any policy
    has (an asynchronous policy's rows are updates, not iterations)."""
    given = run.summary.get("iterations")
    if isinstance(given, int) and not isinstance(given, bool):
        return given
    return int(run.iterations.group_by("policy").len()["len"].max())


def render_index(
    runs: list[Run], series: list[Series], plots: list[tuple[str, str]], warnings: list[str]
) -> str:
    """The Markdown page: runs, stalls, one metrics table per run, then every plot with its
    caption."""
    all_metrics = [series_metrics(s) for s in series]
    shown = tuple(
        k
        for k in METRICS
        if k not in OPTIONAL_METRICS or any(m[k] is not None for m in all_metrics)
    )
    lines = ["# bdsgd report", "", "## Runs", ""]
    for run in runs:
        n, t = int(run.iterations["workers"].max()), run_iterations(run)
        lines.append(
            f"- `{run.name}`: {run.summary.get('kind', '?')} run, {n} workers, "
            f"{t} iterations, traces `{run.summary.get('traces', '?')}` ({run.path})"
        )
    lines += [""] + stall_lines(series)
    lines += [
        "## Metrics",
        "",
        "throughput: gradients applied per second; goodput (when the noise scale is known): "
        "gain(c) per second, one-worker steps of progress; oracle_ratio: throughput / the oracle's "
        "on the same run-times; time_to_loss: seconds until the smoothed loss reaches the "
        'target ("no target": none was set); decision_ms: time to choose c; idle_fraction: '
        "share of worker-seconds waiting or computing dropped gradients.",
        "",
    ]
    for run in runs:
        lines += [f"### {run.name} ({run.summary.get('kind', '?')})", ""]
        own = [s for s in series if s.run is run]
        stalled = any(find_stalls(s) for s in own)
        lines += metrics_table(own, (*shown, "without_stalls") if stalled else shown) + [""]
    lines += slow_rank_lines(runs)
    lines += ["## Plots", ""]
    for name, caption in plots:
        lines += [f"![{name[:-4]}]({name})", "", f"*{caption}*", ""]
    if warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    return "\n".join(lines)


def slow_rank_lines(runs: list[Run]) -> list[str]:
    """The persistently slow ranks and their hosts that a run of one's own loop named
    (``bdsgd.Cutoff``'s summary), slowest first."""
    named = [(run, run.summary.get("slow_ranks") or []) for run in runs]
    if not any(slow for _, slow in named):
        return []
    lines = ["## Persistently slow ranks", "",
             "median run-time against the ranks' median (censored run-times count at their cut, "
             "a lower bound), and the share of iterations the rank was cut in", ""]  # fmt: skip
    for run, slow in named:
        for s in slow:
            lines.append(f"- `{run.name}`: rank {s['rank']} on `{s['host']}`, median "
                         f"{s['median_s'] * 1e3:.1f} ms ({s['ratio']:.2f}x), cut in "
                         f"{s.get('cut_share', 0.0):.0%} of iterations")  # fmt: skip
    return lines + [""]


# -- driver -----------------------------------------------------------------------------------
PANELS_NOTE = (
    "Training runs and each simulate replay get panels of their own (training and replay "
    f"seconds never share an axis), at most {MAX_SERIES} series a panel; a policy has one "
    "colour in every plot, and no two policies share one."
)


def _plot_specs(config: ReportConfig) -> list[tuple[str, str, PlotFn]]:
    return [
        (
            "cutoff.png",
            "Cutoff c per iteration (asynchronous and batch policies: per update), each series "
            "at its true value; lines drawn widest first so that equal values show as nested "
            "stripes, a constant policy's value in its legend entry; live workers the wide "
            "light-grey step behind. " + PANELS_NOTE,
            plot_cutoff,
        ),
        (
            "noise_scale.png",
            "Per iteration: the cutoff c (upper panel of each pair) and the gradient noise "
            "scale B (lower, samples, log scale); a :goodput policy waits for fewer gradients "
            "while B is small. " + PANELS_NOTE,
            plot_noise_scale,
        ),
        (
            "throughput.png",
            "Iteration time (left) and throughput over the last "
            f"{config.rolling_window} iterations (right), over each run's own wall-clock "
            f"seconds. Iterations above {STALL_FACTOR:g}x their series' median (stalls, listed "
            "above) lie beyond the top edge, marked with a triangle and their value, their span "
            "of wall-clock time shaded; the axes are scaled to everything else. " + PANELS_NOTE,
            lambda s: plot_throughput(s, config.rolling_window),
        ),
        (
            "loss.png",
            "Training loss vs wall-clock time (time_to_loss dashed where the smoothed loss "
            "reached the target; a stall's span shaded) and vs gradients applied: throughput "
            "gains count only if the loss falls as fast per second.",
            plot_loss,
        ),
        (
            "heatmap.png",
            "Worker x iteration run-times over the iterations each run used (a simulate run: "
            "the ones it replayed), all panels on one colour scale (the 1st to 99th percentile "
            "of their run-times; beyond, the end colours); red crosses: censored (cut-off) "
            f"workers; magenta stars: run-times above {STALL_FACTOR:g}x the median.",
            plot_heatmap,
        ),
        (
            "cdf.png",
            "Run-time CDF per worker over the iterations each run used (Kaplan-Meier: cut-off "
            "run-times count as censored, not finished), one x scale for all panels; run-times "
            f"above {STALL_FACTOR:g}x the median lie beyond the right edge, a triangle marks "
            "the curve and their values are written in the panel.",
            plot_cdf,
        ),
        (
            "prediction.png",
            "Predicted q10-q90 band and median of the iteration time vs the observed time "
            "(black dots); stalls beyond the top edge, marked with their value.",
            plot_prediction,
        ),
        (
            "decision_ms.png",
            "Time to choose c per iteration (ms), a box per series in its policy's colour.",
            plot_decision_ms,
        ),
    ]


def _save(fig: plt.Figure, path: Path, dpi: int) -> None:
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    _write(path, buf.getvalue())


def _write(path: Path, data: bytes) -> None:
    try:
        write_atomic(path, data)
    except OSError as exc:  # (a full disk: nothing half-written is left)
        raise BdsgdError(f"cannot write {path}: {exc.strerror or exc}") from None


def _ensure_out(out: Path, runs: list[Run]) -> None:
    """Create ``out`` and claim it with the marker before any plot lands there."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BdsgdError(f"cannot create --out {out}: {exc.strerror}") from None
    marker = {"kind": "report", "runs": [str(run.path) for run in runs]}
    _write(out / MARKER, json.dumps(marker, indent=2).encode())


def run_report(config: ReportConfig) -> ReportResult:
    """Read every run directory, then draw each plot that applies and write ``index.md``."""
    check_output_dir(config.out, MARKER, "report", f"{INDEX}, {MARKER} and PNG plots")
    warnings: list[str] = []
    runs = [load_run(p, warnings) for p in config.run_dirs]
    series = make_series(runs)
    _ensure_out(config.out, runs)
    written: list[tuple[str, str]] = []
    for name, caption, draw in _plot_specs(config):
        fig = draw(series)
        if fig is not None:
            _save(fig, config.out / name, config.dpi)
            written.append((name, caption))
    index = config.out / INDEX
    _write(index, render_index(runs, series, written, warnings).encode())
    return ReportResult(index, tuple(config.out / n for n, _ in written), tuple(warnings))
