"""``bdsgd simulate``: replay recorded run-times (or the fitted model's own samples) through every
policy, without a cluster, and compare their throughput with the oracle's.

Sync policies (``mode = "sync"``): iteration t replays trace row t as fresh computations on every
live worker; the iteration ends when the c-th gradient arrives, x_(c), plus ``overhead_s``. The
policy then observes the accepted run-times exactly and every other worker censored at x_(c), as
the engines do. A missing entry (``present`` False) is a dead worker: not live, and
observed censored at the cut. A censored trace entry tau (a train run cut that worker off) means
"arrives no earlier than tau"; the replay uses tau itself, its lower bound, so a policy that waits
for more gradients than the recorded run did gets an optimistic iteration time, and it observes
that entry as censored too.

Asynchronous policies (``k-async``, ``k-batch-sync``): worker w's successive computations take
column w's successive values, starting at the first simulated row; a missing entry is a slot in
which the worker delivers nothing (it takes that row's median run-time). The replay stops when the
first worker runs out of rows. ``overhead_s`` is added per update, and the staleness of every
applied gradient (updates between its read and its write) is recorded.

``--from-frac F`` warms every policy up by observing rows < F*T as the trace recorded them and
simulates only the rest, so a checkpoint fitted on the early part is judged on the held-out tail.

``--noise-scale`` (a constant, or a train run's iterations.parquet) gives the gradient noise scale
by iteration, which the replay cannot measure: before each sync iteration t the policy gets
``set_noise_scale(B_t, batch)`` (the ``:goodput`` policies use it), every sync iteration records
``noise_scale`` and ``gain`` = gain(c_t), and each sync policy reports ``goodput``, sum gain(c_t)
/ sum iteration time (one-worker steps per second; ``bdsgd.stages.goodput``), next to its throughput.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from bdsgd.schemas.run_dir import ITERATIONS, SUMMARY, check_output_dir
from bdsgd.stages.console import console, progress
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.goodput import NoiseSchedule
from bdsgd.stages.policies.async_driver import AsyncDriver, Update
from bdsgd.stages.policies.base import Policy
from bdsgd.stages.policies.cutoff import cut_terms
from bdsgd.stages.policies.driver import IterationDriver, Outcome
from bdsgd.stages.policies.registry import default_policy_specs, make_policy
from bdsgd.stages.policies.selfcheck import self_check_report
from bdsgd.stages.store import RunMatrix, TraceStore

SAMPLE_SEED_OFFSET = 1_000_003
PRED_KEYS = ("pred_q10", "pred_q50", "pred_q90")
RUN_DIR_COLUMNS = (
    "iteration",
    "wall_s",
    "iteration_s",
    "c",
    "workers",
    "decision_ms",
    "staleness",
    *PRED_KEYS,
    "noise_scale",
    "gain",
    "peer",
)


MAX_SAMPLE = 1_000_000  # --sample iterations at most (about 1 ms each to draw, on one core)


@dataclass(frozen=True, kw_only=True)
class SimulateConfig:
    """What ``bdsgd simulate`` replays and through which policies."""

    traces: Path | None = None
    """Trace store to replay; exactly one of ``traces`` and ``sample`` is set."""
    checkpoint: Path | None = None
    """Fitted model: enables the ``bdsgd`` policy and ``sample``."""
    policies: tuple[str, ...] = ()
    """Policy specs to compare; empty: every policy that applies (see ``default_policy_specs``)."""
    overhead_s: float = 0.0
    """Fixed cost added to every iteration (every update for the asynchronous policies), seconds."""
    out: Path | None = None
    """Run directory to write (summary.json, iterations.parquet); None: write nothing."""
    run_id: str | None = None
    """Run of the trace store to replay; None: the run that wrote the store's newest file."""
    from_frac: float = 0.0
    """Fraction of the run's rows that policies only observe (warm-up) before the simulated tail."""
    sample: int | None = None
    """Simulate this many iterations drawn from the checkpoint's model instead of traces."""
    seed: int = 0
    """Seed of the Monte Carlo policies and of model sampling."""
    num_samples: int = 256
    """Joint samples S per decision for ecdf, ewma and bdsgd."""
    explore: float = 0.0
    """Fraction of iterations in which the learning cutoff policies wait for every worker."""
    noise_scale: str | None = None
    """Gradient noise scale fed to the policies: a number of samples, or a train run's
    iterations.parquet (or its run directory) whose ``noise_scale`` column gives it by iteration;
    None: no goodput."""
    batch_size: int | None = None
    """Per-worker batch size the noise scale refers to; None: the train run's config.json, or
    32."""
    micro_batches: int = 1
    """Micro-batches per worker step, for salvage: a worker cut at time tau with run-time x has
    finished floor(m tau / x) of its m micro-batches, and they count as that share of a gradient
    (``samples`` per iteration, ``sample_throughput`` in the metrics). 1: a cut worker's work is
    lost (no salvage metric)."""
    skip_bad_files: bool = False
    """Leave out (with a note) trace files that are unreadable or not valid schema v1, instead
    of refusing the store; the files are never modified."""

    def __post_init__(self) -> None:
        if (self.traces is None) == (self.sample is None):
            raise ConfigError("simulate needs either --traces DIR or --sample T --checkpoint FILE")
        if self.sample is not None and (self.sample < 1 or self.checkpoint is None):
            raise ConfigError("--sample T needs T >= 1 and --checkpoint FILE")
        if self.sample is not None and self.sample > MAX_SAMPLE:
            raise ConfigError(
                f"--sample {self.sample} is above {MAX_SAMPLE:,} iterations (each is drawn from "
                "the model one at a time, then replayed through every policy)"
            )
        if not 0.0 <= self.from_frac < 1.0:
            raise ConfigError(f"--from-frac must be in [0, 1), got {self.from_frac}")
        if not (math.isfinite(self.overhead_s) and self.overhead_s >= 0):
            raise ConfigError(f"--overhead-s must be a finite number >= 0, got {self.overhead_s}")
        if self.num_samples < 1:
            raise ConfigError(f"num_samples must be >= 1, got {self.num_samples}")
        if not 0.0 <= self.explore < 1.0:
            raise ConfigError(f"--explore must be in [0, 1), got {self.explore}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, got {self.micro_batches}")


@dataclass
class PolicyRun:
    """One policy's replay: per-update columns of the run directory's iterations table plus the
    worker-seconds spent on gradients that were applied."""

    name: str
    mode: str
    columns: dict[str, list] = dataclasses.field(default_factory=dict)
    useful_s: float = 0.0
    worker_s: float = 0.0

    def record(self, **values) -> None:
        for key, value in values.items():
            self.columns.setdefault(key, []).append(value)

    def metrics(self, oracle_throughput: float) -> dict:
        """The SPEC metrics of this replay."""
        c = np.asarray(self.columns.get("c", [0]), dtype=float)
        dur = np.asarray(self.columns.get("iteration_s", [0.0]), dtype=float)
        ms = np.asarray(self.columns.get("decision_ms", [0.0]), dtype=float)
        throughput = float(c.sum() / dur.sum()) if dur.sum() > 0 else 0.0
        stale = self.columns.get("staleness", [0.0])
        gains = np.asarray(self.columns.get("gain", [np.nan]), dtype=float)
        goodput = {"goodput": float(gains.sum() / dur.sum())} if "gain" in self.columns else {}
        if "samples" in self.columns and dur.sum() > 0:
            samples = np.asarray(self.columns["samples"], dtype=float)
            goodput["sample_throughput"] = float(samples.sum() / dur.sum())
        return {
            "throughput": throughput,
            **goodput,
            "oracle_ratio": throughput / oracle_throughput if oracle_throughput > 0 else 0.0,
            "mean_c": float(c.mean()),
            "decision_ms": float(np.percentile(ms, 50)),
            "decision_ms_p99": float(np.percentile(ms, 99)),
            "idle_fraction": 1.0 - self.useful_s / self.worker_s if self.worker_s > 0 else 0.0,
            "mean_staleness": float(np.mean(stale)),
            "mode": self.mode,
            "iterations": len(self.columns.get("c", [])),
        }


def warm_up(policy: Policy, run: RunMatrix, stop: int) -> None:
    """Let the policy observe rows < stop as the trace recorded them (dead workers censored at the
    row's largest run-time)."""
    for t in range(stop):
        live = run.present[t]
        if not live.any():
            continue
        cut = np.max(run.runtimes[t, live])
        policy.observe(np.where(live, run.runtimes[t], cut), run.censored[t] | ~live)


def simulate_sync(
    policy: Policy,
    run: RunMatrix,
    start: int,
    overhead_s: float,
    noise: NoiseSchedule | None = None,
    micro_batches: int = 1,
) -> PolicyRun:
    """Replay rows start.. of the run through a sync cutoff policy: each row's live workers
    arrive in order of their run-times, through the same :class:`IterationDriver` the engines
    use. ``micro_batches`` > 1 also records each iteration's ``samples`` with salvage
    (:func:`salvaged`)."""
    result = PolicyRun(policy.name, policy.mode)
    driver = IterationDriver(policy, run.runtimes.shape[1])
    wall = 0.0
    for t in range(start, run.runtimes.shape[0]):
        live = run.present[t]
        if not live.any():
            continue
        x = np.where(live, run.runtimes[t], np.inf)
        if noise is not None:
            policy.set_noise_scale(noise(t), noise.batch_size)
        policy.reveal(x)
        out = drive(driver, live, x, run.censored[t], micro_batches=micro_batches)
        share, end = salvaged(x, live, out.order, out.cut_s, micro_batches)
        wall += end + overhead_s
        result.useful_s += float(x[list(out.order)].sum())
        result.worker_s += float(live.sum()) * (end + overhead_s)
        preds = policy.describe()
        result.record(
            iteration=t,
            wall_s=wall,
            iteration_s=end + overhead_s,
            c=out.c,
            workers=int(live.sum()),
            decision_ms=out.decision_ms,
            staleness=0.0,
            **{k: preds.get(k) for k in PRED_KEYS},
            **noise_columns(noise, t, out.c),
            peer=preds.get("peer"),
        )
        if micro_batches > 1:
            result.record(samples=out.c + share)
    return result


def salvaged(
    runtimes: np.ndarray, live: np.ndarray, admitted, cut_s: float, micro_batches: int
) -> tuple[float, float]:
    """What the live workers cut at ``cut_s`` salvage, in gradients, and when the iteration
    ends, as in a training loop: each finishes the micro-batch it is in (its run-time spread
    evenly over its ``micro_batches``) and adds those it finished, and the all-reduce waits for
    the last of them (:func:`~bdsgd.stages.policies.cutoff.cut_terms`). A worker whose run-time
    is unknown (inf) salvages nothing; one micro-batch: nothing is salvaged and the iteration
    ends at the cut (a cut rank's single micro-batch is its whole step)."""
    cut = live.copy()
    cut[list(admitted)] = False
    x = runtimes[cut]
    x = x[np.isfinite(x)]
    if micro_batches <= 1 or x.size == 0:
        return 0.0, cut_s
    return cut_terms(x[None, :], micro_batches, now=cut_s)


def noise_columns(noise: NoiseSchedule | None, t: int, c: int) -> dict[str, float]:
    """Iteration t's noise scale and gain(c), for the record (none without a schedule)."""
    return {} if noise is None else {"noise_scale": noise(t), "gain": noise.gain(t, c)}


def drive(
    driver: IterationDriver,
    live: np.ndarray,
    runtimes: np.ndarray,
    censored: np.ndarray | None = None,
    order: np.ndarray | None = None,
    micro_batches: int = 1,
) -> Outcome:
    """One iteration of recorded arrivals: the live workers arrive in ``order`` (default: by
    run-time) until the driver ends the iteration (at an arrival, or at a tick between two).
    With ``micro_batches`` > 1, a worker cut in its last micro-batch finishes it, as a training
    loop's rank does, and its run-time is exact (:meth:`IterationDriver.arrive_late`)."""
    driver.begin(live)
    if order is None:
        order = np.argsort(np.where(live, runtimes, np.inf), kind="stable")[: int(live.sum())]
    for w in order:
        if driver.wait_until(float(runtimes[w])) or driver.arrive(int(w), float(runtimes[w])):
            break
    if micro_batches > 1:
        cut = max(float(runtimes[driver.order].max(initial=0.0)), driver.cut_at)
        exact = live & np.isfinite(runtimes)  # (a censored trace entry is a lower bound)
        if censored is not None:
            exact &= ~censored
        for w in np.flatnonzero(exact & (runtimes * (micro_batches - 1) < cut * micro_batches)):
            if w not in driver.order:
                driver.arrive_late(int(w), float(runtimes[w]))
    return driver.end(censored)


class WorkerClock:
    """Each worker's current computation in an asynchronous replay: the trace row it plays and
    when it ends (when it began, and on which parameters, the :class:`AsyncDriver` keeps)."""

    def __init__(self, run: RunMatrix, start: int) -> None:
        rows, n = run.runtimes.shape
        row_median = np.nanmedian(np.where(run.present, run.runtimes, np.nan), axis=1)
        self.dur = np.where(run.present, run.runtimes, np.nan_to_num(row_median)[:, None])
        self.valid = run.present
        self.rows = rows
        self.row = np.full(n, start)
        self.finish = self.dur[start].copy()
        self.exhausted = False

    def live(self) -> np.ndarray:
        """Workers whose current computation will deliver a gradient."""
        return self.valid[np.minimum(self.row, self.rows - 1), np.arange(self.row.size)]

    def delivers(self, w: int) -> bool:
        return bool(self.valid[self.row[w], w])

    def duration(self, w: np.ndarray | int) -> np.ndarray:
        return self.dur[self.row[w], w]

    def restart(self, w: np.ndarray | int, now: float) -> None:
        """Start the next computation of worker(s) w at ``now``."""
        self.row[w] += 1
        if np.any(self.row[w] >= self.rows):
            self.exhausted = True
            return
        self.finish[w] = now + self.dur[self.row[w], w]

    def next_arrival(self) -> tuple[int, float]:
        w = int(np.argmin(self.finish))
        return w, float(self.finish[w])

    def deliveries(self, driver: AsyncDriver) -> Iterator[tuple[int, float, float]]:
        """Gradients in arrival order, as (worker, run-time, arrival time), until the trace runs
        out; a sender then waits for the update (finish = inf), and a slot that delivers nothing
        begins the worker's next computation at once, on the parameters it holds."""
        while not self.exhausted:
            w, at = self.next_arrival()
            if not np.isfinite(at):
                return
            if self.delivers(w):
                self.finish[w] = np.inf
                yield w, float(self.duration(w)), at
            else:
                self.restart(w, at)
                driver.restart(w, at, fresh=False)


def async_update(
    driver: AsyncDriver,
    live: np.ndarray,
    arrivals: Iterable[tuple[int, float, float]],
    overhead_s: float = 0.0,
    free_at: float = 0.0,
) -> Update | None:
    """One update of a k-async replay: K chosen, ``arrivals`` (worker, run-time, arrival time)
    taken in order until K are in, the update applied at the K-th arrival (or once the server is
    free, ``free_at``, if later) plus ``overhead_s``, the senders restarted on the new parameters
    then. None when the arrivals run out first."""
    driver.begin(live)
    for w, runtime_s, at in arrivals:
        if driver.arrive(w, runtime_s):
            update = driver.end(max(at, free_at) + overhead_s)
            driver.restart(list(update.order), update.at)
            return update
    return None


def simulate_k_async(policy: Policy, run: RunMatrix, start: int, overhead_s: float) -> PolicyRun:
    """Replay through a k-async policy: apply every K gradients, stragglers keep computing."""
    result = PolicyRun(policy.name, policy.mode)
    clock = WorkerClock(run, start)
    n = run.runtimes.shape[1]
    driver = AsyncDriver(policy, n)
    server_free = 0.0
    while not clock.exhausted:
        live = clock.live()
        update = async_update(driver, live, clock.deliveries(driver), overhead_s, server_free)
        if update is None:
            break
        senders = np.asarray(update.order, dtype=int)
        result.useful_s += float(clock.duration(senders).sum())
        clock.restart(senders, update.at)
        result.record(
            iteration=driver.version - 1,
            wall_s=update.at,
            iteration_s=update.at - server_free,
            c=update.c,
            workers=int(live.sum()),
            decision_ms=update.decision_ms,
            staleness=float(update.staleness.mean()),
        )
        server_free = update.at
    result.worker_s = n * server_free
    return result


def simulate_k_batch_sync(
    policy: Policy, run: RunMatrix, start: int, overhead_s: float
) -> PolicyRun:
    """Replay through a k-batch-sync policy: K gradients on the same parameters (a worker that
    finishes restarts at once on them and may send again), then everyone restarts (unfinished
    computations cancelled)."""
    result = PolicyRun(policy.name, policy.mode)
    clock = WorkerClock(run, start)
    n, now = run.runtimes.shape[1], 0.0
    driver = AsyncDriver(policy, n)
    while not clock.exhausted:
        live = clock.live()
        k = driver.begin(live)
        arrived_at, useful = now, 0.0
        while len(driver.order) < k and not clock.exhausted:
            w, arrived_at = clock.next_arrival()
            if clock.delivers(w):
                useful += float(clock.duration(w))
                if driver.arrive(w, float(clock.duration(w))):
                    break
            clock.restart(w, arrived_at)
            driver.restart(w, arrived_at)
        if len(driver.order) < k:
            break
        update = driver.end(arrived_at)
        clock.restart(np.arange(n), arrived_at + overhead_s)
        driver.restart(np.arange(n), arrived_at + overhead_s)
        result.useful_s += useful
        result.record(
            iteration=driver.version - 1,
            wall_s=arrived_at + overhead_s,
            iteration_s=arrived_at + overhead_s - now,
            c=k,
            workers=int(live.sum()),
            decision_ms=update.decision_ms,
            staleness=0.0,
        )
        now = arrived_at + overhead_s
    result.worker_s = n * now
    return result


DRIVERS = {
    "sync": simulate_sync,
    "k-async": simulate_k_async,
    "k-batch-sync": simulate_k_batch_sync,
}


def replay(
    policy: Policy,
    run: RunMatrix,
    start: int,
    overhead_s: float,
    noise: NoiseSchedule | None = None,
    micro_batches: int = 1,
) -> PolicyRun:
    """Warm the policy up on rows < start, then replay the rest with the driver of its mode
    (sync policies get the noise schedule and the salvage count)."""
    policy.overhead_s = overhead_s
    policy.salvage_parts = micro_batches if micro_batches > 1 else 0  # (as a loop salvages)
    warm_up(policy, run, start)
    if policy.mode == "sync":
        return simulate_sync(policy, run, start, overhead_s, noise, micro_batches)
    return DRIVERS[policy.mode](policy, run, start, overhead_s)


def noise_schedule(config: SimulateConfig) -> NoiseSchedule | None:
    """``--noise-scale`` read (a one-line ConfigError on bad input); None without it."""
    if config.noise_scale is None:
        return None
    return NoiseSchedule.from_spec(config.noise_scale, config.batch_size)


def compare(
    specs: list[str], run: RunMatrix, config: SimulateConfig
) -> tuple[dict[str, dict], list[PolicyRun]]:
    """Replay the run through every policy; metrics per policy name and the replays themselves."""
    n = run.runtimes.shape[1]
    start = int(config.from_frac * run.runtimes.shape[0])
    kwargs = dict(
        checkpoint=config.checkpoint,
        hosts=list(run.hosts),
        overhead_s=config.overhead_s,
        seed=config.seed,
        iterations=run.runtimes.shape[0] - start,
        num_samples=config.num_samples,
        explore=config.explore,
    )
    policies = [make_policy(spec, n, **kwargs) for spec in specs]
    noise = noise_schedule(config)
    with shown(f"simulate {run.runtimes.shape[0] - start} iterations", len(policies) + 1) as step:
        step(0, "oracle")
        m = config.micro_batches
        oracle = replay(make_policy("oracle", n), run, start, config.overhead_s, noise, m)
        replays = []
        for p in policies:
            step(1, p.name)
            replays.append(replay(p, run, start, config.overhead_s, noise, m))
        step(1, "")
    oracle_throughput = oracle.metrics(1.0)["throughput"]
    metrics = {r.name: r.metrics(oracle_throughput) for r in replays}
    for policy, r in zip(policies, replays, strict=True):
        if (checked := self_check_report(policy)) is not None:
            metrics[r.name]["self_check"] = checked
    return metrics, replays


def load_run(config: SimulateConfig) -> RunMatrix:
    """The run to replay: from the trace store, or drawn from the fitted model."""
    if config.sample is not None:
        return sample_run(config.checkpoint, config.sample, config.seed)
    store = TraceStore(config.traces, skip_bad_files=config.skip_bad_files)
    return store.run_matrix(config.run_id if config.run_id is not None else store.latest_run_id())


@contextlib.contextmanager
def shown(description: str, total: int) -> Iterator[Callable[[int, str], None]]:
    """A progress bar on a terminal, for work that can take minutes (a long run replayed
    through every policy, a large ``--sample``); nothing where stderr is a log or a pipe.
    Yields ``step(done, status)``: ``done`` more steps, then what runs now."""
    if not console.is_terminal:
        yield lambda done, status: None
        return
    with progress() as bar:
        task = bar.add_task(description, total=total, status="")
        yield lambda done, status: bar.update(task, advance=done, status=status)


def sample_run(checkpoint: Path, iterations: int, seed: int) -> RunMatrix:
    """T iterations of joint run-times drawn from the fitted model, each fed back to its filter
    as an uncensored observation (the model generating a run of its own). Its random stream is
    seeded apart from the bdsgd policy's, so the policy does not see the draws coming."""
    from bdsgd.stages.model.predictor import load_predictor

    predictor = load_predictor(checkpoint, seed=seed + SAMPLE_SEED_OFFSET)
    rows = []
    with shown("sampling from the model", iterations) as step:
        for k in range(iterations):
            x = predictor.sample(1)[0].detach().cpu().numpy().astype(float)
            predictor.observe(x, np.zeros(x.shape, dtype=bool))
            rows.append(x)
            if (k + 1) % 100 == 0:
                step(100, "")
        step(iterations % 100, "")
    runtimes = np.stack(rows)
    hosts = tuple(getattr(predictor, "hosts", None) or ["unknown"] * runtimes.shape[1])
    full = np.ones(runtimes.shape, dtype=bool)
    return RunMatrix(f"sample-{checkpoint}", runtimes, ~full, full, hosts)


def best_policies(metrics: dict[str, dict]) -> dict[str, str | None]:
    """The highest-throughput cutoff policy (no stale gradients) and asynchronous one; the
    oracle is a ceiling, not a candidate."""

    def top(modes: tuple[str, ...]) -> str | None:
        names = [k for k, m in metrics.items() if m["mode"] in modes and k != "oracle"]
        return max(names, key=lambda k: metrics[k]["throughput"]) if names else None

    best = {"best": top(("sync",)), "best_async": top(("k-async", "k-batch-sync"))}
    with_goodput = [k for k, m in metrics.items() if "goodput" in m and k != "oracle"]
    if with_goodput:  # --noise-scale: the cutoff policy of the most progress per second
        best["best_goodput"] = max(with_goodput, key=lambda k: metrics[k]["goodput"])
    return best


def run_simulate(config: SimulateConfig) -> dict:
    """Replay and compare; returns simulate's JSON summary (SPEC) and writes ``config.out``."""
    if config.out is not None:
        check_output_dir(
            config.out,
            SUMMARY,
            "simulate",
            f"{SUMMARY} and {ITERATIONS}",
            before_marker=(ITERATIONS,),
        )  # fmt: skip (write_run_dir's order)
    run = load_run(config)
    t, n = run.runtimes.shape
    specs = list(config.policies) or default_policy_specs(n, config.checkpoint is not None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per-decision tensors are tiny: extra threads only contend
    try:
        metrics, replays = compare(specs, run, config)
    finally:
        torch.set_num_threads(threads)
    start = int(config.from_frac * t)
    summary = {
        "workers": n,
        "iterations": t - start,
        "policies": metrics,
        **best_policies(metrics),
        "run_id": run.run_id,
        "from_iteration": start,
        "overhead_s": config.overhead_s,
        "noise_scale": config.noise_scale,
    }
    if config.out is not None:
        write_simulation(config, summary, replays)
    return summary


def write_simulation(config: SimulateConfig, summary: dict, replays: list[PolicyRun]) -> None:
    """The run directory (``bdsgd.schemas.run_dir``): one iterations row per (policy, update)."""
    from bdsgd.schemas.run_dir import iterations_table, write_run_dir

    columns: dict[str, list] = {key: [] for key in ("policy", *RUN_DIR_COLUMNS)}
    for r in replays:
        rows = len(r.columns.get("c", []))
        columns["policy"] += [r.name] * rows
        for key in RUN_DIR_COLUMNS:
            columns[key] += r.columns.get(key, [None] * rows)
    traces = str(config.traces) if config.traces is not None else None
    summary = {"kind": "simulate", "traces": traces, **summary}
    write_run_dir(config.out, summary, iterations_table(columns))
