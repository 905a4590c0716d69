"""``bdsgd fit``: train the deep generative run-time model on a trace store and save a checkpoint.

Each run's last ``holdout`` share of iterations is held out; SVI (ELBO, ClippedAdam) trains on
random windows of the first part of every run and of a copy of it cut off as a cutoff policy
would (see :func:`policy_censored`: the model is used on censored data, so it learns from some),
:mod:`bdsgd.stages.model.recalibrate` measures on the first half of the held-out part how much
slowdown all workers share beyond what the model predicts (so that x_(c) is calibrated), then
:mod:`bdsgd.stages.model.evaluate` scores the
held-out part for the model and the ``window``/``ewma`` baselines, and the checkpoint is written.
Runs recorded under an asynchronous policy (``async``, ``adasync``, ``k-async:K``) are skipped
with a note: their rows count each worker's own computations, not iterations begun together.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import pyro
import torch
from bdsgd.stages.console import console
from bdsgd.stages.errors import ConfigError, TraceError
from bdsgd.stages.heap import retained_heap
from bdsgd.stages.model.checkpoint import (
    MAX_WIDTH,
    Checkpoint,
    Vocab,
    check_writable,
    grown_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from bdsgd.stages.model.clipped_adam import FusedClippedAdam
from bdsgd.stages.model.data import (
    DEFAULT_FEATURES,
    NUM_FEATURES,
    Normaliser,
    RunTensors,
    sample_windows,
    subsample_hosts,
    to_tensors,
)
from bdsgd.stages.model.evaluate import Filtered, NllReport, evaluate, split
from bdsgd.stages.model.recalibrate import common_slowdown, recalibration_spans
from bdsgd.stages.model.runtime_model import ModelConfig, RuntimeModel
from bdsgd.stages.store import RunMatrix, TraceStore, to_run_matrix
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

AUTO_HOST_KS = 0.05
"""The issue's bar for the held-out run-times' PIT KS (issue 31): :attr:`FitConfig.auto_host_ks`."""
AUTO_HOST_ITERATIONS = 100
"""... acted on only where the calibration scored this many iterations: the run-times of one
iteration share its level, so over fewer the KS says more of the few levels seen than of the
predictive's shape (x_(c)'s own 95% bound is above 0.13 there). The demo (30 scored) and
the short runs at new levels (12) are never refitted; the 32-worker clusters of
docs/benchmarks.md (200) can be."""


@dataclass(frozen=True, kw_only=True)
class FitConfig:
    """Everything ``bdsgd fit`` needs; the CLI flags map one-to-one onto these fields."""

    traces: Path
    """Trace store directory (schema v1)."""
    checkpoint: Path
    """Where to write the fitted model (written atomically)."""
    steps: int = 2000
    """SVI steps (one mini-batch of windows each). 2000 rather than 1000: on a held-out cluster
    whose hosts slow down gradually (not in jumps) the online policy gained 1.2-1.9 points of
    oracle_ratio, and it was unchanged on the others (docs/benchmarks.md); a fit at N=32,
    T=2000 takes 51-63 CPU seconds on one core of this project's 2-core machine (docs/benchmarks.md),
    about 4 minutes at N=256."""
    seed: int = 0
    """Seeds parameter initialisation, window sampling and evaluation."""
    init: Path | None = None
    """Continue from this checkpoint: its weights, network sizes and normalisation; its
    vocabulary grown by the new worker ids and hosts."""
    window: int = 48
    """Iterations per training window."""
    batch: int = 16
    """Windows per SVI step."""
    lr: float = 3e-3
    """Initial learning rate; it decays tenfold over the steps."""
    holdout: float = 0.2
    """Share of each run's last iterations held out for val_nll (0: train on all, no val_nll).
    Its first half also measures the shared slowdown (``bdsgd.stages.model.recalibrate``), so the
    reported calibration covers its second half only."""
    z_dim: int = 8
    """Latent state size K."""
    hidden: int = 64
    """Width of the networks."""
    unknown_p: float = 0.1
    """Chance a worker/host is shown as "unknown" in a training window, to learn that embedding."""
    step_workers: int | None = None
    """Workers each SVI step sees, as whole hosts drawn at random (about this many; the
    likelihood weighed by all hosts / the hosts seen): a step's cost then stops growing with N.
    0: every worker. None (the default): :func:`auto_step_workers` of the store, which
    subsamples only stores of 512 workers and more, where each step still sees at least four
    hosts and at most a quarter of the workers (on 16 hosts and more)."""
    host_drops: bool = False
    """Model a host's slow spell ending as well as starting: a host can drop by R_w as a whole
    (its probability and size read from the host's history), beside the jump up. On clusters
    whose hosts switch in and out of slow spells the held-out NLL is 0.07-0.08 better and the
    run-times' calibration a little better, the policy's throughput unchanged there but about
    0.5 points lower where hosts slow down gradually (`arrack`, `throttle`), and a decision
    costs the same at 256 workers, up to 20% more at 1,024 (docs/benchmarks.md, issue 31).
    ``init``: the prior's choice stands. Off, it may still be turned on by ``auto_host_ks``."""
    host_regime: bool = False
    """Filter each host's slow spells as a two-state chain and give the network what it says
    (:class:`bdsgd.stages.model.data.RegimeFilter`: two more history features). On the
    benchmark clusters the held-out NLL is up to 0.10 better and the run-times' calibration
    better (`harsh` KS 0.106 -> 0.065; with ``host_drops`` within 0.05 on all 13), x_(c)'s
    mixed; the throughput up to 1.6 points lower where hosts slow down gradually; the history
    update after each iteration costs about 0.2 ms more (docs/benchmarks.md, issue 31).
    Checkpoint version 7. Off, it may still be turned on by ``auto_host_ks``."""
    auto_host_ks: float = AUTO_HOST_KS
    """Where neither ``host_drops`` nor ``host_regime`` is asked for and there is no ``init``:
    a fit whose held-out run-times are not calibrated (their PIT's KS distance above this) is
    fitted again with both, and the second fit is kept if its KS is lower (the fit then takes
    about twice as long). On the 13 held-out clusters of docs/benchmarks.md it refits the four
    with host slow spells (`syn0`-`syn2`, `harsh`: KS 0.054-0.106 -> 0.013-0.046, throughput
    within 0.0014 or better; within 0.0023 with fit seed 1) and none of the others, where the
    options cost throughput.
    Only where :data:`AUTO_HOST_ITERATIONS` held-out iterations were scored; 1: never."""
    censor_copy: bool = True
    """Also train on a copy of every run censored as a cutoff policy would censor it."""
    eval_samples: int = 256
    """Monte Carlo latent samples per held-out step for the model's joint predictive."""
    threads: int = 1
    """torch CPU threads while fitting (the networks are small: one thread is usually fastest)."""
    progress: bool = True
    """Show a progress bar with the ELBO on stderr."""
    skip_bad_files: bool = False
    """Leave out (with a note) trace files that are unreadable or not valid schema v1, instead
    of refusing the store; the files are never modified."""

    def __post_init__(self) -> None:
        cpus = os.cpu_count() or 1
        checks = {
            "steps must be >= 1": self.steps >= 1,
            "window must be >= 2": self.window >= 2,
            "batch must be >= 1": self.batch >= 1,
            "lr must be > 0": self.lr > 0,
            "holdout must be in [0, 0.9]": 0.0 <= self.holdout <= 0.9,
            f"z_dim and hidden must be in 1..{MAX_WIDTH}": all(
                1 <= size <= MAX_WIDTH for size in (self.z_dim, self.hidden)
            ),
            "unknown_p must be in [0, 1)": 0.0 <= self.unknown_p < 1.0,
            "step_workers must be >= 0": self.step_workers is None or self.step_workers >= 0,
            "eval_samples must be >= 1": self.eval_samples >= 1,
            "auto_host_ks must be in [0, 1]": 0.0 <= self.auto_host_ks <= 1.0,
            f"--threads must be in 1..{cpus} (this machine's CPUs)": 1 <= self.threads <= cpus,
        }
        for message, ok in checks.items():
            if not ok:
                raise ConfigError(f"fit: {message}")


@dataclass(frozen=True)
class FitResult:
    """What a fit produced: SPEC's JSON fields plus the losses and timings."""

    steps: int
    val_nll: float | None
    baseline_nll: dict[str, float] | None
    checkpoint: Path
    fit_s: float
    losses: list[float] = field(repr=False)
    """ELBO loss per SVI step, nats per training entry (lower is better)."""
    calibration: dict | None = None
    """Held-out calibration of the predictive (``bdsgd.stages.model.evaluate.PitCollector``)."""
    step_workers: int = 0
    """The workers each step saw (0: every worker), as :func:`auto_step_workers` or the user
    set it."""
    auto_host: dict | None = None
    """Where ``auto_host_ks`` fitted again: the first fit's run-time KS (``ks``), the second's
    (``refit_ks``) and whether the second was kept (``kept``)."""
    host_drops: bool = False
    """Whether the saved model has host drops (asked for, from ``init``, or kept by
    ``auto_host_ks``)."""
    host_regime: bool = False
    """Whether the saved model filters the host regime (likewise)."""

    def to_json(self) -> dict:
        return {
            "steps": self.steps,
            "step_workers": self.step_workers,
            "val_nll": self.val_nll,
            "baseline_nll": self.baseline_nll,
            "checkpoint": str(self.checkpoint),
            "fit_s": round(self.fit_s, 3),
            "calibration": self.calibration,
            "model": {"host_drops": self.host_drops, "host_regime": self.host_regime},
            "auto_host": self.auto_host,
        }


@dataclass(frozen=True)
class Fitted:
    """A trained, scored model not yet saved, and what the fit reports of it."""

    checkpoint: Checkpoint
    result: FitResult


def run_fit(config: FitConfig) -> FitResult:
    """Train, evaluate on the held-out tails, save the checkpoint; see the module docstring."""
    began = time.perf_counter()
    check_output(config.checkpoint, config.traces)
    prior = load_checkpoint(config.init) if config.init is not None else None
    if prior is not None and config.host_drops and not prior.model.cfg.recovery:
        raise ConfigError(
            f"{config.init}: fitted without host drops; fit without --init to model them"
        )
    runs = _load_runs(config.traces, config.skip_bad_files)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        with retained_heap():
            fitted = _fit(config, runs, prior)
            if wants_refit(config, prior, fitted.result):  # the first saved: a stopped
                save_checkpoint(config.checkpoint, fitted.checkpoint)  # refit keeps it
                fitted = _refit(config, runs, fitted)
    finally:
        torch.set_num_threads(threads)
    save_checkpoint(config.checkpoint, fitted.checkpoint)
    return dataclasses.replace(fitted.result, fit_s=time.perf_counter() - began)


def wants_refit(config: FitConfig, prior: Checkpoint | None, result: FitResult) -> bool:
    """Whether ``auto_host_ks`` asks for a second fit with host drops and the host regime: the
    user asked for neither, gave no ``init`` (whose choice stands), at least
    :data:`AUTO_HOST_ITERATIONS` iterations were scored, and the held-out run-times' KS distance
    is above the bound."""
    ks = runtime_ks(result)
    chosen = config.host_drops or config.host_regime or prior is not None
    scored = ((result.calibration or {}).get("order_stat") or {}).get("count", 0)
    enough = scored >= AUTO_HOST_ITERATIONS
    return not chosen and enough and ks is not None and ks > config.auto_host_ks


def finite_weights(ckpt: Checkpoint) -> bool:
    """Whether every weight of the model is finite (a diverged fit's are not)."""
    return all(bool(torch.isfinite(p).all()) for p in ckpt.model.state_dict().values())


def runtime_ks(result: FitResult) -> float | None:
    """The held-out run-times' PIT KS distance of a fit (None without a held-out part)."""
    runtime = (result.calibration or {}).get("runtime") or {}
    return runtime.get("ks")


def _refit(config: FitConfig, runs: list[RunMatrix], first: Fitted) -> Fitted:
    """Fit again with host drops and the host regime; keep whichever fit has the lower
    held-out run-time KS (the second only with finite weights), and say so. A second fit that
    fails keeps the first: nobody asked for it."""
    ks = runtime_ks(first.result)
    console.print(
        f"fit: the held-out run-times' PIT KS is {ks:.3f}, above {config.auto_host_ks:g} "
        "(--auto-host-ks): fitting again with --host-drops --host-regime"
    )
    richer = dataclasses.replace(config, host_drops=True, host_regime=True)
    try:
        second = _fit(richer, runs, None)
    except Exception as err:  # (not Ctrl-C: the first fit is saved already)
        console.print(f"fit: the second fit failed ({err}); kept the first")
        second = None
    refit_ks = runtime_ks(second.result) if second is not None else None
    kept = refit_ks is not None and refit_ks < ks and finite_weights(second.checkpoint)
    if second is not None:
        shown = "none" if refit_ks is None else f"{refit_ks:.3f}"
        console.print(
            f"fit: kept the {'second' if kept else 'first'} fit (held-out run-time KS: the "
            f"second's {shown}, the first's {ks:.3f})"
        )
    chosen = second if kept else first
    info = {"ks": ks, "refit_ks": refit_ks, "kept": kept}
    ckpt = chosen.checkpoint
    ckpt = dataclasses.replace(ckpt, summary={**ckpt.summary, "auto_host": info})
    return Fitted(ckpt, dataclasses.replace(chosen.result, auto_host=info))


def check_output(checkpoint: Path, traces: Path) -> None:
    """Refuse, before any work, a checkpoint path inside the trace store (its trace files are
    bdsgd's to read, never to replace, and a checkpoint there is not a trace file) or one that
    holds a file other than an earlier checkpoint (:func:`check_writable`)."""
    store, target = Path(traces).resolve(), Path(checkpoint).resolve()
    if store == target or store in target.parents:
        raise ConfigError(
            f"fit: --checkpoint {checkpoint} is inside the trace store {traces}: pass a path "
            "outside it"
        )
    check_writable(checkpoint)


AUTO_FROM = 512
"""The default subsamples only stores this wide (:func:`auto_step_workers`)."""
AUTO_STEP_WORKERS = 64
"""The workers a step sees by default on a large cluster."""
AUTO_MIN_HOSTS = 4
"""... but never fewer than this many hosts' worth."""
AUTO_MAX_SHARE = 0.25
"""Subsample by default only where a step then sees at most this share of the workers."""


def auto_step_workers(runs: list[RunMatrix]) -> int:
    """``step_workers`` when the user gives none: the largest of the runs' own steps
    (:func:`own_step`), where every run it would subsample has a step of its own (at least
    :data:`AUTO_FROM` workers) and is at least four times as wide; else 0 (every worker), so a
    run under 512 workers, or on few large hosts, is never subsampled by default. At 1,024
    workers a full fit takes a quarter of an hour on one core and one that sees 64 a step a
    sixth of it, with ``bdsgd``'s oracle ratio as high (docs/benchmarks.md); at 256 a default
    fit takes about 4 minutes, and there the subsampled fits' x_(c) came out less well
    calibrated on the short runs at a new level (issue 31), so it is left whole. A step that
    saw 2 of 8 hosts fitted 0.007 nats worse, hence the four hosts."""
    wide = [run for run in runs if run.shape[1] > AUTO_STEP_WORKERS]
    own = [own_step(run) for run in wide]
    if not own or 0 in own:
        return 0
    step = max(own)
    subsampled = [run.shape[1] for run in wide if run.shape[1] > step]
    return step if all(step <= AUTO_MAX_SHARE * workers for workers in subsampled) else 0


def own_step(run: RunMatrix) -> int:
    """One run's default step: max(:data:`AUTO_STEP_WORKERS`, :data:`AUTO_MIN_HOSTS` hosts'
    worth of its workers) where it has at least :data:`AUTO_FROM` workers and that is at most
    :data:`AUTO_MAX_SHARE` of them; else 0."""
    workers, hosts = run.shape[1], max(1, len(set(run.hosts)))
    step = max(AUTO_STEP_WORKERS, math.ceil(AUTO_MIN_HOSTS * workers / hosts))
    return step if workers >= AUTO_FROM and step <= AUTO_MAX_SHARE * workers else 0


def _fit(config: FitConfig, runs: list[RunMatrix], prior: Checkpoint | None) -> Fitted:
    """Train on the runs' heads, recalibrate and score on the held-out part; nothing saved."""
    began = time.perf_counter()
    if config.step_workers is None:  # the checkpoint records what the fit did
        config = dataclasses.replace(config, step_workers=auto_step_workers(runs))
    pyro.set_rng_seed(config.seed)
    pyro.clear_param_store()
    train_runs = [_head(r, split(r.shape[0], config.holdout)) for r in runs]
    model, norm, vocab = _setup_model(config, train_runs, prior)
    rng = np.random.default_rng(config.seed)
    shown = train_runs + [policy_censored(r, rng) for r in train_runs if config.censor_copy]
    features = model.cfg.num_features
    losses = train(model, [_tensors(r, norm, vocab, features) for r in shown], config)
    ckpt = Checkpoint(model, norm, vocab, runs[-1].hosts, _plain(config), {})
    spans = recalibration_spans(runs, config.holdout)  # first half of the held-out part
    filtered = Filtered()  # both filter every run from its start to the held-out part
    common = common_slowdown(ckpt, runs, spans, seed=config.seed, filtered=filtered)
    ckpt = dataclasses.replace(ckpt, common=common)
    report = None
    if config.holdout > 0:  # calibration on the second half: neither trained nor recalibrated on
        report = evaluate(ckpt, runs, config.holdout, config.eval_samples, config.seed,
                          calibration_skip=0.5, filtered=filtered)  # fmt: skip
    ckpt = dataclasses.replace(ckpt, summary=_summary(config, runs, report, ckpt.common))
    result = FitResult(
        steps=config.steps,
        val_nll=report.model if report else None,
        baseline_nll={"window": report.window, "ewma": report.ewma} if report else None,
        checkpoint=config.checkpoint,
        fit_s=time.perf_counter() - began,
        losses=losses,
        calibration=report.calibration if report else None,
        step_workers=config.step_workers,
        host_drops=model.cfg.recovery,
        host_regime=model.cfg.num_features == NUM_FEATURES,
    )
    return Fitted(ckpt, result)


def _tensors(run: RunMatrix, norm: Normaliser, vocab: Vocab, num_features: int) -> RunTensors:
    workers = vocab.worker_index(list(range(run.shape[1])))
    return to_tensors(run, norm, workers, vocab.host_index(list(run.hosts)), num_features)


def policy_censored(
    run: RunMatrix, rng: np.random.Generator, below: int = 8, above: int = 3
) -> RunMatrix:
    """A copy of ``run`` censored as a cutoff policy would: at every iteration the first c of
    the present, uncensored run-times arrive, c the best c / x_(c) of that iteration moved by
    ``-below .. above`` (a policy that is unsure waits for fewer); later ones are censored at
    x_(c). The censoring depends only on the iteration's own arrivals, so the censored likelihood
    stays exact."""
    x = np.where(run.present & ~run.censored, run.runtimes, np.inf)
    ordered = np.sort(x, axis=1)
    counts = np.isfinite(ordered).sum(axis=1)
    rate = np.arange(1, x.shape[1] + 1) / ordered
    best = rate.argmax(axis=1) + 1 + rng.integers(-below, above + 1, size=x.shape[0])
    c = np.clip(best, np.minimum(counts, 1), counts)
    cut = np.take_along_axis(ordered, np.maximum(c - 1, 0)[:, None], axis=1)
    late = run.present & (run.runtimes > cut)
    runtimes = np.where(late, np.minimum(run.runtimes, cut), run.runtimes)
    censored = run.censored | late
    return RunMatrix(f"{run.run_id}-cut", runtimes, censored, run.present, run.hosts)


ASYNC_POLICIES = ("async", "adasync", "k-async")


def _load_runs(traces: Path, skip_bad_files: bool = False) -> list[RunMatrix]:
    """Every synchronous run of the store with at least 3 iterations (a held-out tail needs a
    head). Runs of an asynchronous policy are skipped, with a note: their rows are numbered by
    each worker's own computations, so a row is not one iteration that every worker began
    together, which is what the model describes."""
    if not Path(traces).is_dir():
        raise TraceError(f"no trace store at {traces}")
    rows = TraceStore(traces, skip_bad_files=skip_bad_files).read()
    skipped = asynchronous_runs(rows)
    if skipped:
        console.print(
            f"fit: skipping {len(skipped)} asynchronous run(s) ({', '.join(sorted(skipped)[:3])}"
            f"{' ...' if len(skipped) > 3 else ''}): their rows are not synchronous iterations"
        )
    ids = sorted(set(rows["run_id"].unique()) - skipped)
    runs = [to_run_matrix(rows.filter(pl.col("run_id") == rid)) for rid in ids]
    runs = [r for r in runs if r.shape[0] >= 3]
    if not runs:
        raise TraceError(f"trace store {traces} has no synchronous run with at least 3 iterations")
    return runs


def asynchronous_runs(rows: pl.DataFrame) -> set[str]:
    """Run ids whose rows were written under an asynchronous policy (``async``, ``adasync``,
    ``k-async:K``)."""
    policies = rows.select("run_id", "policy").unique()
    kinds = policies["policy"].str.split(":").list.first()
    return set(policies.filter(kinds.is_in(list(ASYNC_POLICIES)))["run_id"].to_list())


def _head(run: RunMatrix, end: int) -> RunMatrix:
    """The first ``end`` iterations of a run (the training part)."""
    return RunMatrix(
        run.run_id, run.runtimes[:end], run.censored[:end], run.present[:end], run.hosts
    )


def _setup_model(
    config: FitConfig, train_runs: list[RunMatrix], prior: Checkpoint | None
) -> tuple[RuntimeModel, Normaliser, Vocab]:
    """A fresh model sized for the runs' workers and hosts, or ``prior`` grown to cover them."""
    base = prior.vocab if prior is not None else Vocab((), ())
    vocab = base.extended([r.hosts for r in train_runs])
    if prior is None:
        cfg = ModelConfig(
            num_features=NUM_FEATURES if config.host_regime else DEFAULT_FEATURES,
            num_workers=len(vocab.worker_ids),
            num_hosts=len(vocab.host_names),
            z_dim=config.z_dim,
            hidden=config.hidden,
            recovery=config.host_drops,
        )
        return RuntimeModel(cfg), Normaliser.fit(train_runs, anchored=True), vocab
    cfg = ModelConfig(
        **{
            **prior.model.cfg.to_dict(),
            "num_workers": len(vocab.worker_ids),
            "num_hosts": len(vocab.host_names),
            # a prior without the position gains it, with --host-regime the regime's (weights 0)
            "num_features": NUM_FEATURES
            if config.host_regime or prior.model.cfg.num_features == NUM_FEATURES
            else DEFAULT_FEATURES,
        }
    )
    model = RuntimeModel(cfg)
    model.load_state_dict(grown_state_dict(model, prior.model))
    return model, prior.norm, vocab


def train(model: RuntimeModel, data: list[RunTensors], config: FitConfig) -> list[float]:
    """SVI on random windows; returns the loss (negative ELBO per training entry) of each step.

    Each step is what ``pyro.infer.SVI.step`` with ``TraceMeanField_ELBO`` does, written out:
    the ELBO's differentiable loss (:meth:`RuntimeModel.negative_elbo`, without Pyro's traces),
    its gradients, one optimizer step of every parameter, the gradients cleared. The model and
    guide use the module's parameters directly instead of registering them with ``pyro.module``
    at every call (72 parameter sites a step, about 1.1-1.7 ms of a 27 ms step), and the same
    updates follow (the same losses to the last bit as Pyro's SVI, ``tests/stages/test_fit.py``).
    ``config.step_workers`` None is every worker here: :func:`run_fit` gives it its default
    (:func:`auto_step_workers`) first."""
    rng = np.random.default_rng(config.seed)
    optim = FusedClippedAdam(lr=config.lr, lrd=0.1 ** (1.0 / config.steps), clip_norm=10.0)
    params = [p for p in model.parameters() if p.requires_grad]
    losses: list[float] = []
    with _progress(config.progress) as bar, pyro.validation_enabled(False):
        task = bar.add_task("fit", total=config.steps, elbo=float("nan"))
        for _ in range(config.steps):
            batch = sample_windows(data, config.window, config.batch, rng)
            # step_workers None (run_fit resolves it by auto_step_workers): every worker here
            batch = subsample_hosts(batch, config.step_workers or 0, rng)
            batch = _mask_unknown(batch, config.unknown_p, rng)
            loss = model.negative_elbo(batch)
            loss.backward()
            optim(params)
            for p in params:
                p.grad = None
            losses.append(loss.item() / max(float(batch.present.sum()) * batch.weight, 1.0))
            bar.update(task, advance=1, elbo=-float(np.mean(losses[-20:])))
    model.eval()
    return losses


def _mask_unknown(batch: RunTensors, p: float, rng: np.random.Generator) -> RunTensors:
    """Show each worker id and host as "unknown" (index 0) with probability ``p``."""
    n = batch.worker_idx.numel()
    keep_w = torch.as_tensor(rng.random(n) >= p)
    keep_h = torch.as_tensor(rng.random(n) >= p)
    return dataclasses.replace(
        batch, worker_idx=batch.worker_idx * keep_w, host_idx=batch.host_idx * keep_h
    )


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]fit"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("ELBO/entry {task.fields[elbo]:.3f}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=False,
    )


def _plain(config: FitConfig) -> dict:
    """The config as plain values for the checkpoint."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(config).items()}


def _summary(
    config: FitConfig, runs: list[RunMatrix], report: NllReport | None, common: tuple
) -> dict:
    return {
        "steps": config.steps,
        "step_workers": config.step_workers,
        "val_nll": report.model if report else None,
        "baseline_nll": {"window": report.window, "ewma": report.ewma} if report else None,
        "calibration": report.calibration if report else None,
        "common_slowdown": list(common),
        "traces": str(config.traces),
        "workers": max(r.shape[1] for r in runs),
        "runs": len(runs),
    }
