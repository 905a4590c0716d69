"""Held-out replay: does the fitted model earn its place on clusters it has not seen the end of?

For each cluster: T iterations x N workers are written to a trace store, ``bdsgd fit`` (default
settings) trains on the first 80% of it, and ``bdsgd simulate --from-frac 0.8`` replays the last
20% through every cutoff policy, censored as the server would see it (the policies first observe
the earlier 80% as recorded). ``oracle_ratio`` is throughput over the oracle's on the same
run-times; "best static" is the best ``static:C`` in hindsight (C = N/2 .. N, step 2).
``bdsgd`` revises c at every arrival (online stopping, the default); ``bdsgd:fixed`` keeps the c
chosen before the iteration, and ``ewma:online`` gives the EWMA peer the same online rule, so the
table separates what the rule buys from what the model buys.

Clusters:

- ``syn0``, ``syn1``, ``syn2``: ``SyntheticCluster`` with default settings, seeds 0, 1, 2 (host
  slow spells, drift, heavy-tailed spikes; ``docs/stragglers.md``);
- ``harsh``: ``SyntheticCluster`` seed 3 with 8 hosts, four-fold slow spells entered twice as
  often, more spikes and a faster, larger drift;
- ``arrack``: *not* our generator (:func:`ar_rack_cluster`): per-worker AR(1) log-speed, host
  slowdowns of random size (x1.5 to x4) lasting gamma-distributed spells, rack-wide congestion
  bursts that decay, gamma noise and rare exponential spikes. The model's structure does not
  match it, which is the point;
- ``throttle``: *not* our generator either (:func:`throttle_cluster`): hosts slow down and recover
  gradually (no jumps), with drift, log-normal noise and Pareto spikes. The hardest of the six
  for the model: a host's workers are cut off for the whole of a slow spell, and how much slower
  than the cut they are is what censoring hides.

And the clusters unlike ours (:data:`UNLIKE`, :mod:`benchmarks.clusters`), at their own sizes,
and the short runs at a level no fit had (:data:`LEVELS`, :func:`evaluate_levels`): four
30-iteration runs of 256 workers at 0.97-1.80 s fitted whole, 24 unseen runs at 0.65 s
(``level-below``) or 2.4 s (``level-above``) each replayed from its first iteration, no warm-up.
Their calibration is given over every iteration and over those after each run's first: the
first is predicted from the prior of a new run's level alone, and the benchmark puts every
replayed run at one level outside the fitted ones, where that prior's PIT is about 0.05 (or
0.95) however well it is calibrated over new runs (``docs/benchmarks.md``, issue 31).

Reproduce: ``.venv/bin/python -c "from benchmarks.bench_heldout import run; print(run())"``
(or ``make bench``). A full run fits six models (65-75 CPU seconds each on 2 cores, at the
default 2000 steps).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from bdsgd.stages.fit import AUTO_HOST_KS, FitConfig, run_fit
from bdsgd.stages.model.checkpoint import NO_RECALIBRATION, load_checkpoint, save_checkpoint
from bdsgd.stages.model.evaluate import PitCollector, baseline_log_lik, model_log_lik
from bdsgd.stages.model.evaluate import evaluate as held_out
from bdsgd.stages.model.recalibrate import common_slowdown, recalibration_spans
from bdsgd.stages.simulate import SimulateConfig, compare
from bdsgd.stages.store import RunMatrix, TraceStore, matrix_rows
from bdsgd.stages.stragglers import SyntheticCluster

from benchmarks import clusters

HOLDOUT_FROM = 0.8
RECALIBRATED_ON = "held-out half, shared slowdown, spread factor below 85%, tightened above 95%, online x_(c) spread, anchored runs"  # marks fit figures made with fit's current recalibration
SYNC = [
    "full",
    "elfving",
    "ecdf",
    "ewma",
    "ewma:online",
    "bdsgd",
    "bdsgd:fixed",
    "bdsgd:unchecked",
]


def ar_rack_cluster(seed: int, iterations: int, workers: int, hosts: int = 8, racks: int = 2):
    """(T, N) run-times and host names from a generator unlike ``SyntheticCluster``."""
    rng = np.random.default_rng(seed + 100)
    host = np.arange(workers) * hosts // workers
    rack = host % racks
    base = np.log(0.05) + rng.normal(0, 0.2, workers)
    ar, slow, left = np.zeros(workers), np.zeros(hosts), np.zeros(hosts, int)
    congestion = np.zeros(racks)
    out = np.zeros((iterations, workers))
    for t in range(iterations):
        ar = 0.95 * ar + rng.normal(0, 0.05, workers)
        for h in range(hosts):
            if left[h] > 0:
                left[h] -= 1
                slow[h] = slow[h] if left[h] else 0.0
            elif rng.random() < 0.008:
                slow[h], left[h] = rng.uniform(0.4, 1.4), int(rng.gamma(2.0, 25)) + 1
        bursts = (rng.random(racks) < 0.01) * rng.uniform(0.5, 1.0, racks)
        congestion = 0.9 * congestion + bursts
        noise = np.log(rng.gamma(12.0, 1 / 12.0, workers))
        spike = (rng.random(workers) < 0.005) * rng.exponential(1.0, workers)
        out[t] = np.exp(base + ar + slow[host] + congestion[rack] + noise + spike)
    return out, [f"h{h}" for h in host]


def throttle_cluster(seed: int, iterations: int, workers: int, hosts: int = 8):
    """(T, N) run-times and host names of hosts that slow down *gradually* (thermal throttling:
    each host's slowdown moves 10% of the way to a target per iteration, the target switching
    between 0 and a random 0.5-1.2 in log with probability 0.01), a cluster-wide drift, log-normal
    noise and Pareto spikes: host-correlated like the others, but without jumps."""
    rng = np.random.default_rng(seed)
    host = np.arange(workers) % hosts
    base = np.log(0.03) + rng.normal(0, 0.15, workers)
    heat, target = np.zeros(hosts), np.zeros(hosts)
    out = np.zeros((iterations, workers))
    for t in range(iterations):
        flip = rng.random(hosts) < 0.01
        target[flip] = np.where(target[flip] > 0, 0.0, rng.uniform(0.5, 1.2, flip.sum()))
        heat += 0.1 * (target - heat)
        drift = 0.3 * np.sin(2 * np.pi * t / 500)
        spike = (rng.random(workers) < 0.01) * rng.pareto(2.0, workers) * 0.5
        out[t] = np.exp(base + heat[host] + drift + rng.normal(0, 0.2, workers) + spike)
    return out, [f"n{h}" for h in host]


def synthetic(seed: int, **kwargs) -> Callable[[int, int], tuple[np.ndarray, list[str]]]:
    def make(iterations: int, workers: int):
        cluster = SyntheticCluster(seed=seed, **kwargs)
        return cluster.delays(iterations, workers), cluster.host_of(workers)

    return make


SYNTHETIC: dict[str, dict] = {
    "syn0": dict(seed=0),
    "syn1": dict(seed=1),
    "syn2": dict(seed=2),
    "harsh": dict(
        seed=3,
        hosts=8,
        slow_factor=4.0,
        p_slow=0.02,
        p_recover=0.1,
        spike_p=0.03,
        drift=0.5,
        drift_period=300,
    ),
}
"""The clusters of :data:`CLUSTERS` drawn by :class:`SyntheticCluster`: its settings."""

CLUSTERS: dict[str, Callable[[int, int], tuple[np.ndarray, list[str]]]] = {
    **{name: synthetic(**settings) for name, settings in SYNTHETIC.items()},
    "arrack": lambda t, n: ar_rack_cluster(0, t, n),
    "throttle": lambda t, n: throttle_cluster(5, t, n),
}


def write_store(
    path: Path, runtimes: np.ndarray, hosts: list[str], run_id: str = "heldout"
) -> RunMatrix:
    """One fully observed run (schema v1, source ``import``) added to a trace store."""
    full = np.ones(runtimes.shape, dtype=bool)
    run = RunMatrix(run_id, runtimes, ~full, full, tuple(hosts))
    TraceStore(path).append(matrix_rows(run))
    return run


@dataclass(frozen=True)
class Unlike:
    """A cluster of :mod:`benchmarks.clusters`: its runs at its own size, and the fit steps (fewer
    at N = 1024, where a full step costs about 30 times one at N = 32; ``fit`` now subsamples a
    store of 1,024 workers by default, ``fit.auto_step_workers``)."""

    runs: Callable[[], list[tuple[np.ndarray, list[str]]]]
    workers: int
    iterations: int
    steps: int


UNLIKE: dict[str, Unlike] = {
    "lognormal": Unlike(lambda: [clusters.lognormal_wide(11, 1000, 256)], 256, 1000, 1000),
    "pareto": Unlike(lambda: [clusters.pareto_tails(12, 2000, 64)], 64, 2000, 2000),
    "gammamix": Unlike(lambda: [clusters.gamma_mixture(13, 500, 1024)], 1024, 500, 300),
    "load": Unlike(lambda: [clusters.load_levels(14, 1000, 256)], 256, 1000, 1000),
    "short": Unlike(lambda: clusters.short_runs(15, 30, 64), 64, 50, 1000),
}


def cluster_runs(name: str, iterations: int, workers: int) -> tuple[list, int]:
    """The runs of cluster ``name`` and its fit steps (ours: one run at the given size)."""
    if name in UNLIKE:
        spec = UNLIKE[name]
        return spec.runs(), spec.steps
    return [CLUSTERS[name](iterations, workers)], 0


@dataclass(frozen=True)
class Flags:
    """The choices of ``bdsgd fit`` a row is fitted with (``--host-drops``, ``--host-regime``,
    ``--auto-host-ks``); the defaults are ``fit``'s."""

    host_drops: bool = False
    host_regime: bool = False
    auto_host_ks: float = AUTO_HOST_KS

    def __str__(self) -> str:
        names = ("host_drops", "host_regime")
        chosen = [f"`--{k.replace('_', '-')}`" for k in names if getattr(self, k)]
        if self.auto_host_ks != AUTO_HOST_KS:
            chosen.append(f"`--auto-host-ks {self.auto_host_ks:g}`")
        return f", every fit with {' '.join(chosen)}" if chosen else ""

    def fitted(self, fit: dict) -> bool:
        """Whether the saved figures ``fit`` were fitted with these choices (a choice a saved
        fit does not name was off: fitted before ``fit`` had it)."""
        return all(fit.get(k, UNNAMED[k]) == v for k, v in dataclasses.asdict(self).items())


UNNAMED = {"host_drops": False, "host_regime": False, "auto_host_ks": 1.0}
"""A choice a saved fit does not name: off (it was fitted before ``fit`` had it)."""


FIT_DEFAULTS = Flags()


def fit_cluster(
    name: str, runs: list, steps: int, root: Path, flags: Flags = FIT_DEFAULTS
) -> tuple[list[RunMatrix], dict]:
    """Write the runs to a store under ``root`` and fit on each run's first 80% (with
    ``flags``' choices); the fit's figures. A checkpoint already in ``root`` (same cluster, same
    ``flags``) is reused with the figures saved beside it, not fitted again (re-replaying after
    a policy change costs no fit)."""
    traces, checkpoint, saved = root / name, root / f"{name}.pt", root / f"{name}.fit.json"
    fit = json.loads(saved.read_text()) if saved.exists() else {}
    if traces.exists() and checkpoint.exists() and fit and flags.fitted(fit):
        matrices = TraceStore(traces).run_matrices()
        if fit.get("recalibrated_on") != RECALIBRATED_ON:  # fitted before fit did: do it now
            fit.update(recalibrated(checkpoint, matrices))
            saved.write_text(json.dumps(fit))
        return matrices, fit
    shutil.rmtree(traces, ignore_errors=True)
    written = [write_store(traces, x, h, f"heldout-{i:03d}") for i, (x, h) in enumerate(runs)]
    began = time.perf_counter()
    choices = dataclasses.asdict(flags)
    config = FitConfig(traces=traces, checkpoint=checkpoint, steps=steps, progress=False, **choices)
    fit = {**run_fit(config).to_json(), "fit_s": time.perf_counter() - began, **choices}
    fit["recalibrated_on"] = RECALIBRATED_ON
    saved.write_text(json.dumps(fit))
    return written, fit


def recalibrated(checkpoint: Path, runs: list[RunMatrix]) -> dict:
    """What ``fit`` now does after training, for a checkpoint fitted before it did: measure the
    shared slowdown on the first half of the held-out part, save it in the checkpoint, score
    the held-out part (calibration on its second half)."""
    ckpt = dataclasses.replace(load_checkpoint(checkpoint), common=NO_RECALIBRATION)
    spans = recalibration_spans(runs, FitConfig.holdout)
    ckpt = dataclasses.replace(ckpt, common=common_slowdown(ckpt, runs, spans))
    save_checkpoint(checkpoint, ckpt)
    report = held_out(ckpt, runs, FitConfig.holdout, calibration_skip=0.5)
    return {"val_nll": report.model, "calibration": report.calibration,
            "common_slowdown": list(ckpt.common), "recalibrated_on": RECALIBRATED_ON}  # fmt: skip


def evaluate(
    name: str, iterations: int, workers: int, steps: int, root: Path, flags: Flags = FIT_DEFAULTS
) -> dict:
    """Fit on the head (with ``flags``' choices), replay every run's tail; oracle_ratio per
    policy (sums of gradients and seconds over all runs' tails) and the fit's figures."""
    runs, own_steps = cluster_runs(name, iterations, workers)
    workers = runs[0][0].shape[1]
    matrices, fit = fit_cluster(name, runs, own_steps or steps, root, flags)
    step = max(2, workers // 32)
    statics = [f"static:{c}" for c in range(workers // 2, workers + 1, step)]
    config = SimulateConfig(
        traces=root / name, checkpoint=root / f"{name}.pt", from_frac=HOLDOUT_FROM
    )
    per_run = [compare([*SYNC, *statics, "oracle"], run, config)[0] for run in matrices]
    ratio = pooled_ratios(per_run)
    best_static = max(statics, key=ratio.__getitem__)
    bdsgd = per_run[-1]["bdsgd"]
    return {
        "name": name,
        "workers": workers,
        "runs": len(matrices),
        **fit,
        "ratio": ratio,
        "best_static": best_static,
        "bdsgd_c": bdsgd["mean_c"],
        "bdsgd_ms": bdsgd["decision_ms"],
        "self_check": {k: m.get("self_check") for k, m in per_run[-1].items() if "bdsgd" in k},
        "leaned_share": pooled_leaning(per_run, "bdsgd"),
    }


def pooled_leaning(per_run: list[dict[str, dict]], name: str) -> float:
    """Share of all runs' replayed iterations in which the self-checking ``name`` played a peer's
    c."""
    checks = [m[name].get("self_check") or {} for m in per_run]
    decided = sum(c.get("decided", 0) for c in checks)
    return sum(c.get("leaned", 0) for c in checks) / decided if decided else 0.0


def pooled_ratios(per_run: list[dict[str, dict]]) -> dict[str, float]:
    """Each policy's throughput over all runs' replayed tails (sum of gradients over sum of
    seconds) as a ratio to the oracle's."""

    def rate(name: str) -> float:
        grads = sum(m[name]["mean_c"] * m[name]["iterations"] for m in per_run)
        secs = sum(
            m[name]["mean_c"] * m[name]["iterations"] / m[name]["throughput"] for m in per_run
        )
        return grads / secs

    oracle = rate("oracle")
    return {name: rate(name) / oracle for name in per_run[0] if name != "oracle"}


@dataclass(frozen=True)
class Levels:
    """A cluster of :func:`benchmarks.clusters.level_runs`: four short runs at four load levels
    fitted whole (``fit`` still holds out each one's last 20% for its own figures), and
    ``replays`` more runs at ``level``, which the fit never saw, each replayed from its first
    iteration with no warm-up (as a user who fitted on earlier jobs starts a new one). The first
    is the issue's single fifth run; the others (the same workers, their own noise) pool the
    figures over 30 x ``replays`` iterations, which one 30-iteration run is too short to pin
    (30 values of x_(c))."""

    level: float
    seed: int = 31
    steps: int = 1000
    replays: int = 24


LEVELS: dict[str, Levels] = {
    "level-below": Levels(clusters.LEVEL_BELOW),
    "level-above": Levels(clusters.LEVEL_ABOVE),
}


def evaluate_levels(name: str, root: Path, flags: Flags = FIT_DEFAULTS) -> dict:
    """Fit the four fitted levels (once for every cluster of ``LEVELS`` with the same seed and
    steps; with ``flags``' choices), replay the unseen run through every policy; the row as
    :func:`evaluate` gives it, with the NLL and calibration measured on the replayed run."""
    spec = LEVELS[name]
    fitted_levels = clusters.LEVELS_FITTED
    runs = clusters.level_runs(spec.seed, (*fitted_levels, *[spec.level] * spec.replays))
    fitted = f"levels-{spec.seed}-{spec.steps}"
    _, fit = fit_cluster(fitted, runs[: len(fitted_levels)], spec.steps, root, flags)
    shutil.rmtree(root / name, ignore_errors=True)
    replayed = [
        write_store(root / name, *run, run_id=f"{name}-{i:02d}")
        for i, run in enumerate(runs[len(fitted_levels) :])
    ]
    checkpoint = root / f"{fitted}.pt"
    workers = replayed[0].shape[1]
    statics = [f"static:{c}" for c in range(workers // 2, workers + 1, max(2, workers // 32))]
    config = SimulateConfig(traces=root / name, checkpoint=checkpoint, from_frac=0.0)
    per_run = [compare([*SYNC, *statics, "oracle"], run, config)[0] for run in replayed]
    ratio = pooled_ratios(per_run)
    bdsgd = per_run[0]["bdsgd"]
    return {
        "name": name,
        "workers": workers,
        "runs": len(replayed),
        "fit_s": fit["fit_s"],
        **replay_scores(load_checkpoint(checkpoint), replayed),
        "ratio": ratio,
        "first_run": pooled_ratios(per_run[:1]),
        "best_static": max(statics, key=ratio.__getitem__),
        "bdsgd_c": bdsgd["mean_c"],
        "bdsgd_ms": bdsgd["decision_ms"],
        "self_check": {k: m.get("self_check") for k, m in per_run[-1].items() if "bdsgd" in k},
        "leaned_share": pooled_leaning(per_run, "bdsgd"),
    }


class RunPits:
    """One run's PIT values (:class:`PitCollector`'s ``add``) sent to ``whole``, to ``seen``
    from the run's second iteration on (the predictive once the run's level has been seen), and
    to ``at[t]`` for each of its first ``len(at)`` iterations t."""

    def __init__(self, whole: PitCollector, seen: PitCollector, at: list[PitCollector]):
        self.whole, self.seen, self.at, self.t = whole, seen, at, 0

    def add(self, *values) -> None:
        self.whole.add(*values)
        if self.t >= 1:
            self.seen.add(*values)
        if self.t < len(self.at):
            self.at[self.t].add(*values)
        self.t += 1


START = 5  # replay_scores' per-iteration figures: the runs' first START iterations
SEEN = "calibration_seen"  # a level row's calibration after each run's first iteration


def replay_scores(ckpt, runs: list[RunMatrix], samples: int = 256) -> dict:
    """NLL per run-time of the model and the baselines on the whole of ``runs``, each filtered
    from its first iteration, and the model's calibration there: on every iteration's PIT
    values (``calibration``), on those after each run's first iteration (``calibration_seen``:
    the first is predicted before anything of the run is seen, from the prior of a new run's
    level alone) and the mean PITs at each of the runs' first :data:`START` iterations
    (``start_pit``: run-times, x_(c))."""
    whole, seen, at = PitCollector(), PitCollector(), [PitCollector() for _ in range(START)]
    entries = sum(int(run.present.sum()) for run in runs)
    model = sum(
        model_log_lik(ckpt, run, 0, samples, 0, RunPits(whole, seen, at), 0) for run in runs
    )
    window, ewma = np.sum([baseline_log_lik(run, 0) for run in runs], axis=0)
    return {
        "val_nll": -model / entries,
        "baseline_nll": {"window": -window / entries, "ewma": -ewma / entries},
        "calibration": whole.summary(),
        SEEN: seen.summary(),
        "start_pit": [mean_pits(p) for p in at],
    }


def mean_pits(pits: PitCollector) -> tuple[float | None, float | None]:
    """The mean PIT of the run-times and of x_(c) that ``pits`` holds (None: none held)."""
    return tuple(float(np.mean(u)) if len(u) else None for u in pits.values())


JUDGED = ("full", "elfving", "ecdf", "ewma")  # with the best static: the peers bdsgd must match


def best_peer(row: dict) -> tuple[str, float]:
    """The judged peer with the highest oracle_ratio (the best static in hindsight included)."""
    q = row["ratio"]
    candidates = {**{k: q[k] for k in JUDGED}, row["best_static"]: q[row["best_static"]]}
    name = max(candidates, key=candidates.__getitem__)
    return name, candidates[name]


def coverage(row: dict, key: str) -> str:
    c = (row.get("calibration") or {}).get(key, {}).get("coverage")
    return "-" if c is None else f"{c:.0%}"


def pit_ks(row: dict, key: str, part: str = "calibration") -> str:
    """The KS distance, and in brackets the one a calibrated predictive stays under in 95% of
    samples of as many values (``pit_summary``'s ``ks_p95``); ``part``: the row's calibration
    of every scored iteration or, for the level clusters, ``calibration_seen``."""
    found = (row.get(part) or {}).get(key, {})
    ks, bound = found.get("ks"), found.get("ks_p95")
    if ks is None:
        return "-"
    return f"{ks:.3f}" if bound is None else f"{ks:.3f} [{bound:.3f}]"


def host_options(row: dict) -> str:
    """What the row's saved model has of ``fit``'s host options, "(refit)" where
    ``--auto-host-ks`` turned them on; "-" for neither (or a fit from before it said)."""
    model = row.get("model") or {}
    chosen = [name for name, key in (("drops", "host_drops"), ("regime", "host_regime"))
              if model.get(key)]  # fmt: skip
    refit = " (refit)" if (row.get("auto_host") or {}).get("kept") else ""
    return " + ".join(chosen) + refit if chosen else "-"


def table(rows: list[dict]) -> str:
    lines = [
        "| cluster | N | host options | bdsgd | best peer | bdsgd - best peer | leaned | "
        "bdsgd:unchecked | bdsgd:fixed | ewma | ecdf | elfving | best static | full | "
        "90% PI: run-times / x_(c) "
        "| PIT KS [calibrated 95%]: run-times / x_(c) "
        "| the same after each run's first iteration | val_nll (window / ewma) | "
        "decision ms p50 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        q, b = r["ratio"], r["baseline_nll"]
        peer, value = best_peer(r)
        lines.append(
            f"| {r['name']} | {r['workers']} | {host_options(r)} | **{q['bdsgd']:.3f}** | "
            f"{value:.3f} (`{peer}`) | "
            f"{q['bdsgd'] - value:+.3f} | {r['leaned_share']:.0%} | "
            f"{q['bdsgd:unchecked']:.3f} | {q['bdsgd:fixed']:.3f} | {q['ewma']:.3f} | "
            f"{q['ecdf']:.3f} | {q['elfving']:.3f} | {q[r['best_static']]:.3f} | {q['full']:.3f} | "
            f"{coverage(r, 'runtime')} / {coverage(r, 'order_stat')} | "
            f"{pit_ks(r, 'runtime')} / {pit_ks(r, 'order_stat')} | "
            f"{pit_ks(r, 'runtime', SEEN)} / {pit_ks(r, 'order_stat', SEEN)} | {r['val_nll']:.2f} "
            f"({b['window']:.2f} / {b['ewma']:.2f}) | {r['bdsgd_ms']:.2f} |"
        )
    return "\n".join(lines)


def run(quick: bool = False, flags: Flags = FIT_DEFAULTS) -> str:
    """The table; every cluster fitted with ``flags``' choices of ``bdsgd fit``."""
    iterations, workers, steps = (600, 16, 150) if quick else (2000, 32, FitConfig.steps)
    names = ["syn0", "arrack"] if quick else [*CLUSTERS, *UNLIKE]
    with tempfile.TemporaryDirectory(prefix="bdsgd-heldout-") as tmp:
        rows = [evaluate(n, iterations, workers, steps, Path(tmp), flags) for n in names]
        rows += [evaluate_levels(n, Path(tmp), flags) for n in LEVELS]
    return "\n".join(
        [
            "## Held-out replay (`bdsgd fit` on the first 80%, `bdsgd simulate --from-frac 0.8`)",
            "",
            f"Ours: {iterations} iterations x {workers} workers per cluster, fit with {steps or 'auto'} "
            "steps; the unlike clusters at their own sizes and steps (`UNLIKE`)"
            f"{flags}. oracle_ratio "
            "of each policy on the held-out 20% (see `benchmarks/bench_heldout.py` and "
            '`docs/stragglers.md` for the clusters). Reproduce: `.venv/bin/python -c "from '
            f"benchmarks.bench_heldout import Flags, run; print(run(quick={quick}, "
            f'flags={flags!r}))"`.',
            "",
            table(rows),
            "",
        ]
    )
