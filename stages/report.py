"""``bdsgd report``: draw what happened in one or more run directories.

A run directory (``schemas/run_dir.py``) holds ``summary.json`` and ``iterations.parquet``; a
train run holds one policy, a simulate run several. Every (run, policy) pair is one *series*, and
every plot overlays all series, so runs of different policies compare on the same axes:

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
MAX_CDF_CURVES = 16  # above this many workers, CDFs are drawn per host
LINESTYLES = ("-", "--", "-.", (0, (1, 1)))  # with the 10 colours: 40 distinguishable series
ASYNC_POLICIES = ("async", "adasync", "k-async", "k-batch-sync")
STEPS_LABEL = "iteration (from the run's or replay's first)"


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
    """One series per (run, policy); the run's name joins the label when a policy repeats."""
    pairs = [(run, p) for run in runs for p in run.iterations["policy"].unique(maintain_order=True)]
    counts: dict[str, int] = {}
    for _, p in pairs:
        counts[p] = counts.get(p, 0) + 1
    return [
        Series(
            label=p if counts[p] == 1 else f"{p} ({run.name})",
            run=run,
            policy=p,
            rows=run.iterations.filter(pl.col("policy") == p).sort("iteration"),
            color=f"C{i % 10}",
            linestyle=LINESTYLES[i // 10 % len(LINESTYLES)],
        )
        for i, (run, p) in enumerate(pairs)
    ]


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


def plot_cutoff(series: list[Series]) -> plt.Figure:
    """c per iteration: synchronous policies in one panel (x: iterations), asynchronous ones in
    another (x: updates, c = K gradients per update); live workers once per run, grey."""
    groups = [g for g in ([s for s in series if not s.asynchronous],
                          [s for s in series if s.asynchronous]) if g]  # fmt: skip
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 4 * len(groups)), squeeze=False)
    for ax, group in zip(axes[:, 0], groups, strict=True):
        for s, nudge in zip(group, nudges(len(group)), strict=True):
            ax.step(s.steps(), _values(s, "c") + nudge, where="post", lw=0.9, label=s.label,
                    **s.style)  # fmt: skip
        _live_workers(ax, group)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        kind = (
            "asynchronous and batch policies (x: updates)"
            if group[0].asynchronous
            else ("synchronous policies")
        )
        xlabel = (
            "update (from the run's or replay's first)" if group[0].asynchronous else STEPS_LABEL
        )
        ax.set(xlabel=xlabel, ylabel="c (gradients applied)", title=f"Cutoff c, {kind}")
        _legend_outside(ax)
    fig.tight_layout()
    return fig


def nudges(n: int) -> np.ndarray:
    """Vertical offsets (at most +-0.2) that keep n series of equal integer c apart."""
    step = min(0.05, 0.4 / max(n - 1, 1))
    return (np.arange(n) - (n - 1) / 2) * step


def _live_workers(ax: plt.Axes, group: list[Series]) -> None:
    """The live workers of each run in ``group`` (the same for every policy of a simulate run),
    a dotted grey step along the run's longest series."""
    runs = list({id(s.run): s.run for s in group}.values())
    for run in runs:
        s = max((x for x in group if x.run is run), key=lambda x: x.rows.height)
        name = f" ({run.name})" if len(runs) > 1 else ""
        ax.step(s.steps(), _values(s, "workers"), where="post", ls=":", lw=1.2, color="grey",
                label=f"live workers{name}")  # fmt: skip


def plot_noise_scale(series: list[Series]) -> plt.Figure | None:
    """c (top) over the gradient noise scale B (bottom, samples, log scale): a ``:goodput``
    policy waits for fewer gradients while B is small (see docs/policies.md)."""
    noisy = [s for s in series if has_values(s, "noise_scale")]
    if not noisy:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for s in noisy:
        it, noise = s.steps(), _values(s, "noise_scale")
        top.step(it, _values(s, "c"), where="post", lw=0.9, label=s.label, **s.style)
        bottom.plot(it, np.where(np.isfinite(noise), noise, np.nan), lw=0.9, **s.style)
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.set(ylabel="c (gradients applied)", title="Cutoff c and the gradient noise scale")
    bottom.set(xlabel=STEPS_LABEL, ylabel="noise scale B (samples)", yscale="log")
    _legend_outside(top)
    fig.tight_layout()
    return fig


def plot_throughput(series: list[Series], window: int) -> plt.Figure:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for s in series:
        wall, secs = _values(s, "wall_s"), _values(s, "iteration_s")
        top.plot(wall, secs, lw=0.6, label=s.label, **s.style)
        bottom.plot(wall, rolling_throughput(_values(s, "c"), secs, window), **s.style)
    top.set(ylabel="iteration time (s)", title="Iteration time and throughput")
    bottom.set(xlabel="wall-clock time (s)", ylabel=f"gradients/s (rolling {window})")
    _legend_outside(top)
    fig.tight_layout()
    return fig


def plot_loss(series: list[Series]) -> plt.Figure | None:
    with_loss = [s for s in series if has_values(s, "loss")]
    if not with_loss:
        return None
    reached = 0  # series whose time_to_loss is drawn (a dashed line)
    fig, (by_time, by_grads) = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for s in with_loss:
        loss = _values(s, "loss")
        by_time.plot(_values(s, "wall_s"), loss, lw=0.8, **s.style)
        by_grads.plot(np.cumsum(_values(s, "c")), loss, lw=0.8, label=s.label, **s.style)
        ttl = _summary_for(s).get("time_to_loss")
        if isinstance(ttl, (int, float)) and np.isfinite(ttl):
            by_time.axvline(ttl, ls="--", color=s.color, lw=0.8)
            reached += 1
    target = next(
        (s.run.summary["target_loss"] for s in with_loss if "target_loss" in s.run.summary), None
    )
    if isinstance(target, (int, float)):
        by_grads.axhline(target, color="grey", ls=":", lw=0.8, label="target loss")
        by_time.axhline(target, color="grey", ls=":", lw=0.8)
    by_time.set(xlabel="wall-clock time (s)", ylabel="training loss",
                title=_loss_title(reached, isinstance(target, (int, float))))  # fmt: skip
    by_grads.set(xlabel="gradients applied (cumulative c)", title="Loss vs gradients applied")
    _legend_outside(by_grads)
    fig.tight_layout()
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


def plot_heatmap(series: list[Series]) -> plt.Figure | None:
    runs = _runs_with_traces(series)
    if not runs:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.5 + 2 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        m = run.matrix
        low, high = robust_range(m.runtimes[m.present])
        img = ax.imshow(
            np.where(m.present, m.runtimes, np.nan).T,
            aspect="auto",
            interpolation="nearest",
            origin="lower",
            cmap="viridis",
            vmin=low,
            vmax=high,
        )
        it, wk = np.nonzero(m.censored & m.present)
        size = 30 if m.shape[0] <= 100 else 6  # crosses must not hide a long run
        ax.scatter(it, wk, marker="x", s=size, color="red", lw=0.8, label="censored (cut off)")
        ax.set(xlabel="iteration", ylabel="worker", title=f"Run-times, {run.name} ({m.run_id})")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(img, ax=ax, label="run-time (s), 1st-99th percentile", extend="both")
        if len(it):
            ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    return fig


def robust_range(values: np.ndarray) -> tuple[float, float]:
    """The colour scale of a heatmap: the 1st to 99th percentile of the run-times, so that one
    stall (a 2.4 s iteration among 20 ms ones) does not flatten every other cell; cells beyond
    take the end colours."""
    if values.size == 0:
        return 0.0, 1.0
    low, high = np.percentile(values, [1, 99])
    return float(low), float(max(high, low + 1e-9))


def _cdf_groups(m: RunMatrix) -> dict[str, np.ndarray]:
    """Worker columns to pool per curve: one per worker, or one per host when there are many."""
    n = m.shape[1]
    if n <= MAX_CDF_CURVES:
        return {f"worker {w}": np.array([w]) for w in range(n)}
    hosts = np.array(m.hosts)
    return {f"host {h}": np.nonzero(hosts == h)[0] for h in dict.fromkeys(m.hosts)}


def plot_cdf(series: list[Series]) -> plt.Figure | None:
    runs = _runs_with_traces(series)
    if not runs:
        return None
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        m = run.matrix
        for label, cols in _cdf_groups(m).items():
            present = m.present[:, cols]
            t, f = kaplan_meier(m.runtimes[:, cols][present], m.censored[:, cols][present])
            if len(t):
                ax.step(t, f, where="post", lw=0.9, label=label)
        ax.set(xlabel="run-time (s)", ylabel="P(run-time <= x)", title=f"Run-time CDF, {run.name}")
        ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    return fig


def plot_prediction(series: list[Series]) -> plt.Figure | None:
    predicted = [s for s in series if has_values(s, "pred_q50")][:MAX_PANELS]
    if not predicted:
        return None
    fig, axes = plt.subplots(
        len(predicted), 1, figsize=(9, 2.5 + 2 * len(predicted)), squeeze=False
    )
    for ax, s in zip(axes[:, 0], predicted, strict=True):
        it, actual = s.steps(), _values(s, "iteration_s")
        lo, mid, hi = _values(s, "pred_q10"), _values(s, "pred_q50"), _values(s, "pred_q90")
        ax.fill_between(it, lo, hi, alpha=0.3, color=s.color, step="mid", label="predicted q10-q90")
        ax.plot(it, mid, lw=0.8, color=s.color, label="predicted median")
        ax.plot(it, actual, ".", ms=3, color="black", label="observed")
        known = np.isfinite(lo) & np.isfinite(hi)
        coverage = np.mean((actual[known] >= lo[known]) & (actual[known] <= hi[known]))
        ax.set(
            xlabel=STEPS_LABEL,
            ylabel="iteration time (s)",
            title=f"{s.label}: observed inside q10-q90 {coverage:.0%} of iterations (ideal 80%)",
        )
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_decision_ms(series: list[Series]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(series)), 4))
    data = [_values(s, "decision_ms") for s in series]
    ax.boxplot(data, showfliers=True)
    ax.set_xticks(
        range(1, len(series) + 1), [s.label for s in series], rotation=20, fontsize="small"
    )
    if all(np.all(d > 0) for d in data):
        ax.set_yscale("log")
    ax.set(ylabel="decision time (ms)", title="Time to choose c per iteration")
    fig.tight_layout()
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


def series_metrics(s: Series) -> dict[str, float | str | None]:
    """The SPEC metrics of one series: the run's summary where it states them, else computed
    from its iterations (throughput = sum c / sum iteration time; decision_ms percentiles)."""
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
    if "time_to_loss" in given and given["time_to_loss"] is None:
        metrics["time_to_loss"] = "not reached"
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
    lines = ["| policy | " + " | ".join(shown) + " |", "|---" * (len(shown) + 1) + "|"]
    for s in series:
        m = series_metrics(s)
        lines.append(f"| {s.policy} | " + " | ".join(_fmt(m[k]) for k in shown) + " |")
    return lines


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
    """The Markdown page: runs, one metrics table per run, then every plot with its caption."""
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
    lines += [
        "",
        "## Metrics",
        "",
        "throughput: gradients applied per second; goodput (when the noise scale is known): "
        "gain(c) per second, one-worker steps of progress; oracle_ratio: throughput / the oracle's "
        "on the same run-times; time_to_loss: seconds until the smoothed loss reaches the "
        "target; decision_ms: time to choose c; idle_fraction: share of worker-seconds "
        "waiting or computing dropped gradients.",
        "",
    ]
    for run in runs:
        lines += [f"### {run.name} ({run.summary.get('kind', '?')})", ""]
        lines += metrics_table([s for s in series if s.run is run], shown) + [""]
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
def _plot_specs(config: ReportConfig) -> list[tuple[str, str, PlotFn]]:
    return [
        (
            "cutoff.png",
            "Cutoff c per iteration (each policy its own colour and line style, nudged apart "
            "by at most 0.2 so that equal values stay visible; iterations counted from each "
            "run's or replay's first), live workers grey dotted; asynchronous and batch "
            "policies, whose steps are updates, in a panel of their own.",
            plot_cutoff,
        ),
        (
            "noise_scale.png",
            "Cutoff c over the gradient noise scale B (samples): where B is small a few "
            "gradients are worth nearly as much as many, and :goodput policies wait for fewer.",
            plot_noise_scale,
        ),
        (
            "throughput.png",
            "Iteration time and rolling throughput (gradients/s) over wall-clock time.",
            lambda s: plot_throughput(s, config.rolling_window),
        ),
        (
            "loss.png",
            "Training loss vs wall-clock time (time_to_loss dashed where the smoothed loss "
            "reached the target) and vs gradients applied: throughput gains count only if the "
            "loss falls as fast per second.",
            plot_loss,
        ),
        (
            "heatmap.png",
            "Worker x iteration run-times (colour scale: the 1st to 99th percentile, so one "
            "stall does not flatten the rest; beyond, the end colours); red crosses: censored "
            "(cut-off) workers.",
            plot_heatmap,
        ),
        (
            "cdf.png",
            "Run-time CDF per worker (Kaplan-Meier: cut-off run-times count as "
            "censored, not finished).",
            plot_cdf,
        ),
        (
            "prediction.png",
            "Predicted q10-q90 band of the iteration time vs the observed time.",
            plot_prediction,
        ),
        ("decision_ms.png", "Decision time per iteration (ms), per policy.", plot_decision_ms),
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
