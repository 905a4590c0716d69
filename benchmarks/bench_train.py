"""Real training runs on an emulated straggler cluster, policies side by side, and the engine's
overhead against a plain all_reduce loop.

Both engines (collective and ps) run every policy on the same cluster. The cluster: a synthetic drifting cluster with host-correlated slow regimes (not the defaults of
``SyntheticCluster``), N=6 workers. Its first 70% becomes a trace store the model is fitted on;
the rest is replayed (``--stragglers replay:``) as injected delays under every policy, so each
policy meets the same held-out cluster. ``time_to_loss`` uses, for every policy, the smoothed loss
that ``full`` reaches at 60% of its iterations.

Reproduce: ``make bench`` (or ``python -m benchmarks.run --only train``); the goodput
time-to-loss tables alone: ``python -c "from benchmarks.bench_train import goodput_only;
print(goodput_only())"``; the engines-and-policies table alone: ``policies_only``; ``bdsgd`` on
both engines, three interleaved runs each: ``bdsgd_engines``; the overhead table alone:
``overhead_section(False)``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from bdsgd.stages.engine.config import EngineConfig
from bdsgd.stages.engine.launch import run_engine
from bdsgd.stages.fit import FitConfig, run_fit
from bdsgd.stages.policies.registry import make_policy
from bdsgd.stages.smoothing import SmoothedLoss, time_to_loss
from bdsgd.stages.store import TraceStore
from bdsgd.stages.stragglers import SyntheticCluster
from bdsgd.stages.train import TrainConfig, run_train

from benchmarks.allreduce import allreduce_iterations_per_s

WORKERS = 6
CLUSTER = SyntheticCluster(
    base_s=0.04,
    hosts=3,
    worker_spread=0.1,
    sigma=0.2,
    slow_factor=4.0,
    p_slow=0.03,
    p_recover=0.08,
    drift=0.4,
    drift_period=300,
    spike_p=0.02,
    spike_alpha=1.3,
    seed=11,
)


def write_cluster(root: Path, total: int, split: float) -> tuple[Path, Path]:
    """The emulated cluster as two trace stores: the fitting part and the held-out part."""
    delays = CLUSTER.delays(total, WORKERS)
    hosts = CLUSTER.host_of(WORKERS)
    cut = int(total * split)
    stores = []
    for name, part in (("early", delays[:cut]), ("late", delays[cut:])):
        t, n = part.shape
        rows = dict(
            run_id=[f"cluster-{name}"] * (t * n),
            iteration=np.repeat(np.arange(t), n).tolist(),
            worker=np.tile(np.arange(n), t).tolist(),
            host=[hosts[w] for w in np.tile(np.arange(n), t)],
            world_size=[n] * (t * n),
            start_s=np.repeat(np.cumsum(part.max(1)) - part.max(1), n).tolist(),
            runtime_s=part.reshape(-1).tolist(),
            censored=[False] * (t * n),
            cutoff=[None] * (t * n),
            policy=["full"] * (t * n),
            source=["import"] * (t * n),
        )
        TraceStore(root / name).append(rows)
        stores.append(root / name)
    return stores[0], stores[1]


COLLECTIVE_SPECS = ("full", f"static:{WORKERS - 1}", f"static:{WORKERS - 2}", "ecdf", "ewma",
                    "bdsgd", "bdsgd:fixed")  # fmt: skip
PS_SPECS = ("full", f"static:{WORKERS - 1}", f"static:{WORKERS - 2}", "ewma", "bdsgd")


def policy_runs(root: Path, late: Path, ckpt: Path, iterations: int) -> dict[str, dict]:
    """Every policy on both engines, same held-out cluster; keys ``engine/policy``."""
    out = {}
    for engine, specs in (("collective", COLLECTIVE_SPECS), ("ps", PS_SPECS)):
        for spec in specs:
            summary, log = train_run(root, late, ckpt, iterations, spec, engine=engine)
            out[f"{engine}/{spec}"] = {"summary": summary, "log": log}
    # --salvage: cut-off replicas contribute the micro-batches they finished
    summary, log = train_run(
        root, late, ckpt, iterations, "bdsgd", engine="collective", salvage=True
    )
    out["collective/bdsgd --salvage"] = {"summary": summary, "log": log}
    return out


def train_run(root: Path, late: Path, ckpt: Path, iterations: int, spec: str, **settings):
    """One ``bdsgd train`` run on the held-out cluster; its summary and iterations table."""
    name = "-".join([*map(str, settings.values()), spec.replace(":", "")])
    cfg = TrainConfig(
        workers=WORKERS,
        iterations=iterations,
        policy=spec,
        traces=root / "train-traces",
        out=root / f"run-{name}",
        checkpoint=ckpt,
        stragglers=f"replay:{late}",
        seed=0,
        **settings,
    )
    summary = run_train(cfg)
    return summary, pq.read_table(cfg.out / "iterations.parquet").to_pydict()


def train_section(root: Path, quick: bool) -> str:
    late, fitted = fit_cluster(root, quick)
    lines = policy_table(root, late, fitted, quick)
    repeats = 1 if quick else 3
    lines += ["", f"`bdsgd` on the three engines, {repeats} interleaved run(s) each:", ""]
    lines += bdsgd_engine_table(root, late, repeats, quick).splitlines()
    goodput = [
        goodput_section(root, late, root / "model.pt", 20.0 if quick else 60.0, batch)
        for batch in GOODPUT_BATCHES
    ]
    lines += ["", "### Goodput: time to loss with the progress-per-second objective", ""]
    lines += "\n\n".join(goodput).splitlines()
    return "\n".join(lines)


def fit_cluster(root: Path, quick: bool) -> tuple[Path, str]:
    """The held-out cluster (early part fitted, late part replayed) and a line on the fit."""
    early, late = write_cluster(root, total=1000 if quick else 2000, split=0.7)
    began = time.perf_counter()
    fit = run_fit(
        FitConfig(
            traces=early, checkpoint=root / "model.pt", steps=300 if quick else 1000, progress=False
        )
    )
    fitted = (
        f"model fitted in {time.perf_counter() - began:.0f} s (val_nll {fit.val_nll:.3f} vs "
        f"window {fit.baseline_nll['window']:.3f}, ewma {fit.baseline_nll['ewma']:.3f})"
    )
    return late, fitted


def policy_table(root: Path, late: Path, fitted: str, quick: bool) -> list[str]:
    """Every policy on both engines on the held-out cluster, one row each."""
    runs = policy_runs(root, late, root / "model.pt", 80 if quick else 200)
    full_loss = [x for x in runs["collective/full"]["log"]["loss"] if x is not None]
    mid = int(0.6 * len(full_loss))
    target = float(np.mean(full_loss[mid - 5 : mid + 5]))
    lines = [
        f"Emulated cluster: N={WORKERS}, held-out replay; {fitted}. "
        f"time_to_loss target: the smoothed training loss collective `full` reaches at 60% of "
        f"its iterations, {target:.3f}. Best static per engine in **bold**.",
        "",
        "| engine | policy | throughput (grad/s) | vs full (same engine) | mean_c | final_loss | time_to_loss (s) | wall_s | decision_ms p50 / p99 | idle_fraction | join lag ms p50 / p99 | censored rows |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in runs.items():
        engine, spec = key.split("/")
        s, base = r["summary"], runs[f"{engine}/full"]["summary"]["throughput"]
        ttl = time_to_loss(r["log"], target)
        censored = _censored_rows(root / "train-traces", s["run_id"])
        lag = (f"{s['join_lag_ms_p50']:.2f} / {s['join_lag_ms_p99']:.2f}"
               if "join_lag_ms_p50" in s else "-")  # fmt: skip
        name = f"**{spec}**" if spec == _best_static(runs, engine) else spec
        lines.append(
            f"| {engine} | {name} | {s['throughput']:.1f} | {s['throughput'] / base:.2f}x | {s['mean_c']:.2f} | "
            f"{s['final_loss']:.3f} | {'-' if ttl is None else f'{ttl:.1f}'} | {s['wall_s']:.1f} | "
            f"{s['decision_ms_p50']:.2f} / {s['decision_ms_p99']:.2f} | {s['idle_fraction']:.2f} | {lag} | {censored} |"
        )
    return lines


def policies_only(quick: bool = False) -> str:
    """The engines-and-policies table alone (no goodput runs)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        late, fitted = fit_cluster(root, quick)
        return "\n".join(policy_table(root, late, fitted, quick))


def goodput_only(quick: bool = False) -> str:
    """The goodput tables alone: the cluster, the fit, and :func:`goodput_section` per batch."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        late, _ = fit_cluster(root, quick)
        return "\n\n".join(
            goodput_section(root, late, root / "model.pt", 20.0 if quick else 60.0, batch)
            for batch in GOODPUT_BATCHES
        )


def bdsgd_engines(repeats: int = 3, quick: bool = False) -> str:
    """:func:`bdsgd_engine_table` alone, with its own cluster and fit."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        late, _ = fit_cluster(root, quick)
        return bdsgd_engine_table(root, late, repeats, quick)


def bdsgd_engine_table(root: Path, late: Path, repeats: int, quick: bool) -> str:
    """``bdsgd`` on the three engines (the loop: the library a user's script takes),
    interleaved ``repeats`` times on the held-out cluster (the fit in ``root``), so they are
    compared by medians rather than by one run each."""
    runs: dict[str, list[dict]] = {"collective": [], "ps": [], "loop": []}
    for i in range(repeats):
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]  # neither always runs first
        for engine in order:
            summary, _ = train_run(root / f"repeat-{i}", late, root / "model.pt",
                                   80 if quick else 200, "bdsgd", engine=engine)  # fmt: skip
            runs[engine].append(summary)
    lines = ["| engine | ranks training | throughput (grad/s), each run | median | mean_c median | "
             "wall_s median | final loss median |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for engine, summaries in runs.items():
        grads = [s["throughput"] for s in summaries]
        losses = [s["final_loss"] for s in summaries if s["final_loss"] is not None]
        lines.append(
            f"| {engine} | {WORKERS} of {WORKERS + (engine != 'loop')} processes | "
            f"{' / '.join(f'{g:.1f}' for g in grads)} | {np.median(grads):.1f} | "
            f"{np.median([s['mean_c'] for s in summaries]):.2f} | "
            f"{np.median([s['wall_s'] for s in summaries]):.1f} | "
            f"{np.median(losses) if losses else float('nan'):.3f} |"
        )
    return "\n".join(lines)


def _best_static(runs: dict, engine: str) -> str:
    statics = [k for k in runs if k.startswith(f"{engine}/static")]
    return max(statics, key=lambda k: runs[k]["summary"]["throughput"]).split("/")[1]


GOODPUT_SPECS = ("full", f"static:{WORKERS - 1}", f"static:{WORKERS - 2}", "bdsgd",
                 "bdsgd:goodput")  # fmt: skip
GOODPUT_BATCHES = (32, 256)  # per-worker batches: noise scale above N batches throughout / not
ITERATION_CAP = 100_000  # the goodput runs end at their wall-clock budget or target, not here


def goodput_section(root: Path, late: Path, ckpt: Path, budget_s: float, batch: int) -> str:
    """Time to two losses (early and late in training) with ``--lr-scaling adascale`` for every
    policy on the collective engine, each on the same wall-clock budget (``--max-wall-s``): a
    policy that waits for fewer workers runs more, cheaper iterations. The targets are the
    smoothed loss ``full`` reaches after 20% and 80% of the budget; the other policies stop at
    the late one (``--stop-at-target``) or at the budget. The mlp's gradient noise scale grows
    as it trains, so gain(c) approaches c and the goodput objective's c approaches the
    throughput objective's. ``batch``: the per-worker batch b; the objective changes c where
    the noise scale B is near or below N b (gain(c) = c (phi + 1) / (phi + c), phi = B / b)."""
    common = dict(lr_scaling="adascale", batch_size=batch, max_wall_s=budget_s)
    runs = {"full": train_run(root, late, ckpt, ITERATION_CAP, "full", **common)}
    targets = smoothed_loss_at(runs["full"][1], (0.2, 0.8))
    for spec in GOODPUT_SPECS[1:]:
        runs[spec] = train_run(root, late, ckpt, ITERATION_CAP, spec, **common,
                               target_loss=targets[1], stop_at_target=True)  # fmt: skip
    lines = [
        f"Collective engine, N={WORKERS}, the held-out cluster above (replayed from its start "
        f"again by a run that outlasts it), per-worker batch {batch}, "
        f"`--lr-scaling adascale` for every policy, each run on the same budget of "
        f"{budget_s:.0f} s (`--max-wall-s`), ended early once at the late target "
        f"(`--stop-at-target`). Targets: the smoothed training loss `full` reaches after 20% "
        f"({targets[0]:.3f}) and 80% ({targets[1]:.3f}) of the budget.",
        "",
        "| policy | time_to_loss early (s) | time_to_loss late (s) | iterations | throughput "
        "(grad/s) | mean_c | mean_c first / last 20% | noise scale first / last 20 iterations |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for spec, (s, log) in runs.items():
        ttl = [time_to_loss(log, target) for target in targets]
        noise = [v for v in log.get("noise_scale", []) if v is not None]
        scale = f"{np.mean(noise[:20]):.0f} / {np.mean(noise[-20:]):.0f}" if noise else "-"
        c, fifth = log["c"], max(len(log["c"]) // 5, 1)
        lines.append(
            f"| {spec} | {_seconds(ttl[0])} | {_seconds(ttl[1])} | {s['iterations']} | "
            f"{s['throughput']:.1f} | {s['mean_c']:.2f} | {np.mean(c[:fifth]):.2f} / "
            f"{np.mean(c[-fifth:]):.2f} | {scale} |"
        )
    return "\n".join(lines)


def smoothed_loss_at(log: dict, fractions: tuple[float, ...]) -> list[float]:
    """The smoothed training loss (as ``time_to_loss`` smooths it) at the first iteration past
    each fraction of the run's wall clock."""
    smooth, by_time = SmoothedLoss(), []
    for loss, wall in zip(log["loss"], log["wall_s"], strict=True):
        if (value := smooth.add(loss)) is not None:
            by_time.append((wall, value))
    end = by_time[-1][0]
    return [next(v for w, v in by_time if w >= f * end) for f in fractions]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _censored_rows(traces: Path, run_id: str) -> int:
    df = TraceStore(traces).read()
    return int(df.filter((df["run_id"] == run_id) & df["censored"]).height)


def engine_iterations_per_s(
    workers: int,
    iterations: int,
    micro_batches: int,
    engine: str,
    allreduce: str = "auto",
    eval_every: int = 10,
) -> float:
    """The engine's iterations per second (policy full, no stragglers), over all but the first
    tenth of the iterations (at most 50: the start-up, before announcements run ahead).
    ``eval_every`` above ``iterations`` leaves out the held-out evaluation, which the all_reduce
    loop does not do."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = EngineConfig(
            workers=workers,
            iterations=iterations,
            run_id="overhead",
            source="train",
            engine=engine,
            micro_batches=micro_batches,
            hosts=("local",) * workers,
            allreduce=allreduce,
            eval_every=eval_every,
        )
        res = run_engine(cfg, make_policy("full", workers), Path(tmp) / "traces", lambda t, r: None)
    wall = np.asarray(res.log["wall_s"])
    warm = min(50, iterations // 10)
    return (iterations - warm) / (wall[-1] - wall[warm - 1])


def overhead_section(quick: bool, repeats: int = 3, sizes: tuple[int, ...] = (2, 4, 6)) -> str:
    """Both engines (policy full, no stragglers) against all_reduce, same workers, interleaved;
    with the default 4 micro-batches and with 1, and the collective engine also with gloo's ring
    (``--allreduce ring``; ``auto`` sums by star here) and without the held-out evaluation
    every 10 iterations (work the loop does not do: the engine's own cost alone). Each figure
    is the median of ``repeats`` runs (single runs on a shared 2-core machine vary by 20-30%),
    over 1,000 iterations (the steady state of a run; the all_reduce loop after 5 warm-up
    iterations, the engines after 50)."""
    iterations = 60 if quick else 1000
    never = iterations + 1
    configs = {"collective4": ("collective", 4, "auto", 10),
               "collective1": ("collective", 1, "auto", 10),
               "ring4": ("collective", 4, "ring", 10), "ps4": ("ps", 4, "auto", 10),
               "ps1": ("ps", 1, "auto", 10), "noeval4": ("collective", 4, "auto", never),
               "noeval1": ("collective", 1, "auto", never)}  # fmt: skip
    lines = [
        "| workers | all_reduce it/s | collective (4) | collective (1) | collective, ring (4) | "
        "ps (4) | ps (1) | collective ratio (4) / (1) | ring ratio (4) | ps ratio (4) / (1) | "
        "collective without the held-out loss, ratio (4) / (1) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in (2, 4) if quick else sizes:
        runs: dict[str, list[float]] = {}
        for _ in range(1 if quick else repeats):
            runs.setdefault("ar", []).append(allreduce_iterations_per_s(n, iterations))
            for key, (engine, m, allreduce, every) in configs.items():
                its = engine_iterations_per_s(n, iterations, m, engine, allreduce, every)
                runs.setdefault(key, []).append(its)
        ar, c4, c1, r4, p4, p1, e4, e1 = (float(np.median(runs[k])) for k in ("ar", *configs))
        lines.append(
            f"| {n} | {ar:.1f} | {c4:.1f} | {c1:.1f} | {r4:.1f} | {p4:.1f} | {p1:.1f} | "
            f"{c4 / ar:.2f}x / {c1 / ar:.2f}x | {r4 / ar:.2f}x | {p4 / ar:.2f}x / {p1 / ar:.2f}x | "
            f"{e4 / ar:.2f}x / {e1 / ar:.2f}x |"
        )
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        policies = train_section(Path(tmp), quick)
    return "\n".join(
        [
            "## Training on an emulated straggler cluster (`bdsgd train`)",
            "",
            policies,
            "",
            "## Engine overhead against plain all_reduce (no stragglers, mlp, batch 32)",
            "",
            overhead_section(quick),
            "",
            "With `full` (or `static:C`) the collective engine's replicas decide alone: one "
            "store round trip per block of up to 64 announced iterations (and 50 ms), the "
            "reports in the sum (by star on one machine, `--allreduce auto`; the ring column is "
            "gloo's all-reduce), the steps published 32 at a time, the coordinator off the "
            "critical path; what remains is the coordinator process sharing the cores (its log "
            "and trace rows, its store thread), the noise-scale statistics and the held-out "
            "loss every 10 iterations, each replica evaluating its slice (the last column runs "
            "without it: the loop does not evaluate). The ps engine also sends the parameters "
            "to every worker and steps serially at the server while the workers wait. On a "
            "busy machine run it under `chrt -r 10`: other load hits the all_reduce ring "
            "hardest.",
        ]
    )
