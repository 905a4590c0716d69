"""``bdsgd fit``: train the deep generative run-time model on a trace store and save a checkpoint.

Each run's last ``holdout`` share of iterations is held out; SVI (ELBO, ClippedAdam) trains on
random windows of the first part of every run and of a copy of it cut off as a cutoff policy
would (see :func:`policy_censored`: the model is used on censored data, so it learns from some),
:mod:`bdsgd.stages.model.recalibrate` measures on the first half of the held-out part how much
slowdown all workers share beyond what the model predicts (so that x_(c) is calibrated), then
:mod:`bdsgd.stages.model.evaluate` scores the
held-out part for the model and the ``window``/``ewma`` baselines, :func:`assess` marks the
model unusable where those scores say a policy should not lean on it (``usable`` in the
checkpoint's summary, with one line on stderr; ``probation`` where only its calibration
failed), and the checkpoint is written. The steps scale
with the data (:func:`auto_steps`) and training stops early when the ELBO of the held-out
part's first half stops improving (:class:`EarlyStop`); a store whose runs are all shorter
than :data:`MIN_ITERATIONS` is refused.
Runs recorded under an asynchronous policy (``async``, ``adasync``, ``k-async:K``) are skipped
with a note: their rows count each worker's own computations, not iterations begun together.
"""

from __future__ import annotations

import copy
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
    ANCHOR_Q,
    DEFAULT_FEATURES,
    NUM_FEATURES,
    PER_ENTRY,
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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from scipy.special import smirnovi

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
    steps: int | None = None
    """Most SVI steps (one mini-batch of windows each). None (``--steps auto``, the default):
    :func:`auto_steps` of the training part, from :data:`AUTO_MIN_STEPS` for a few thousand
    run-times to :data:`AUTO_MAX_STEPS` from about 50,000 (32 workers x 1,600 iterations).
    With ``early_stop`` the fit may stop before, where its stopping span holds at least
    :data:`STOP_MIN_ENTRIES` run-times (32 workers x 320 iterations)."""
    early_stop: bool = True
    """Stop when the ELBO of the stopping span (the first half of each run's held-out part, the
    span the recalibration measures on; never trained on) has not improved by
    :data:`STOP_MIN_DELTA` nats per run-time over :data:`STOP_PATIENCE` checks, and keep the
    weights of its best check (:class:`EarlyStop`). Nothing stops without a held-out part, or
    where that span holds fewer than :data:`STOP_MIN_ENTRIES` run-times."""
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
            "steps must be >= 1": self.steps is None or self.steps >= 1,
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
    planned_steps: int = 0
    """The steps the fit could take (``steps`` or :func:`auto_steps`); ``steps`` is those it
    took before it stopped (:class:`EarlyStop`)."""
    usable: bool = True
    """Whether the held-out scores pass :func:`assess` (written into the checkpoint's summary:
    a policy runs its fallback from the first iteration on a model that does not)."""
    unusable_reason: str | None = None
    """Why not, in one line (None where usable)."""
    probation: bool = False
    """Not usable only for its calibration: ``bdsgd`` runs the model in its peers' shadow and
    lets it decide once its record leads theirs (:func:`assess`)."""

    def to_json(self) -> dict:
        return {
            "steps": self.steps,
            "planned_steps": self.planned_steps,
            "usable": self.usable,
            "unusable_reason": self.unusable_reason,
            "probation": self.probation,
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
    """Train, evaluate on the held-out tails, mark whether the model is usable
    (:func:`assess`), save the checkpoint; see the module docstring."""
    began = time.perf_counter()
    check_output(config.checkpoint, config.traces)
    prior = load_checkpoint(config.init) if config.init is not None else None
    if prior is not None and config.host_drops and not prior.model.cfg.recovery:
        raise ConfigError(
            f"{config.init}: fitted without host drops; fit without --init to model them"
        )
    runs = _load_runs(config.traces, config.skip_bad_files)
    check_enough(runs)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        with retained_heap(), FitBar(config.progress) as bar:
            fitted = _fit(config, runs, prior, bar)
            if wants_refit(config, prior, fitted.result):  # the first saved: a stopped
                save_checkpoint(
                    config.checkpoint, _marked(fitted, runs).checkpoint
                )  # refit keeps it
                fitted = _refit(config, runs, fitted, bar)
    finally:
        torch.set_num_threads(threads)
    fitted = _marked(fitted, runs)
    if not fitted.result.usable:
        console.print(f"fit: {fitted.result.unusable_reason}", soft_wrap=True)  # one line
    save_checkpoint(config.checkpoint, fitted.checkpoint)
    return dataclasses.replace(fitted.result, fit_s=time.perf_counter() - began)


MIN_ITERATIONS = 20
"""Fewer iterations than this in every run: ``fit`` refuses (:func:`check_enough`): the
held-out part (its last 20%) is then 4 iterations or fewer, too few to stop, recalibrate or
score a fit on."""
PROFILE_ITERATIONS = 120
"""The shortest profile ``fit`` recommends (docs/faq.md): two and a half training windows of
48 iterations, and a held-out part of 24 to recalibrate and score on."""
MIN_SCORED_ITERATIONS = 10
"""Fewer held-out iterations scored for calibration than this: the model is marked unusable
(:func:`assess`); a run of 100 iterations has 10 with the default ``holdout``."""
USABLE_KS = 0.1
"""A held-out PIT KS distance at or under this never marks a model unusable (:func:`assess`)."""
USABLE_KS_P = 0.005
"""... nor one a calibrated predictive exceeds with at least this chance (one-sided) over as
many values: over few held-out values a large KS is noise."""


def check_enough(runs: list[RunMatrix]) -> None:
    """Refuse, in one line, a store whose runs are all shorter than :data:`MIN_ITERATIONS`."""
    longest = max(run.shape[0] for run in runs)
    if longest < MIN_ITERATIONS:
        raise ConfigError(
            f"fit: the longest run has {longest} iterations, too few to fit and score a model "
            f"(at least {MIN_ITERATIONS}): profile at least {PROFILE_ITERATIONS} iterations, "
            "or train with --policy ecdf"
        )


def scored_iterations(runs: list[RunMatrix], holdout: float) -> int:
    """The iterations whose calibration a fit reports: the second half of each run's held-out
    part (``evaluate``'s ``calibration_skip=0.5``)."""
    scored = 0
    for run in runs:
        t = run.shape[0]
        start = split(t, holdout)
        scored += t - (start + int(0.5 * (t - start)))
    return scored


def ks_bar(count: int) -> float:
    """The PIT KS distance above which :func:`assess` calls ``count`` held-out values
    uncalibrated: :data:`USABLE_KS`, or what a calibrated predictive exceeds with chance
    :data:`USABLE_KS_P` over ``count`` values if that is larger."""
    return max(USABLE_KS, float(smirnovi(max(count, 1), USABLE_KS_P)))


def assess(
    result: FitResult, runs: list[RunMatrix], holdout: float = 0.2
) -> tuple[str, bool] | None:
    """Why the fitted model is not fit for a policy to lean on, in one line, and whether only
    its calibration failed (the model goes on probation), or None. Unusable: its held-out NLL
    is not finite or worse than the ``window`` baseline's, or the calibration scored fewer than
    :data:`MIN_SCORED_ITERATIONS` iterations (too few to tell). On probation, where neither
    holds: the held-out PIT KS of the run-times or of x_(c) is above :func:`ks_bar` of its
    count (``bdsgd`` then starts on its simple peers and lets the model decide only once its
    record in their shadow leads: :mod:`bdsgd.stages.policies.selfcheck`). A fit without a
    held-out part is not assessed."""
    if result.val_nll is None:
        return None
    problems, calibration = [], []
    scored = scored_iterations(runs, holdout)
    if scored < MIN_SCORED_ITERATIONS:
        problems.append(f"its calibration scored {scored} held-out iterations, too few to tell "
                        f"(at least {MIN_SCORED_ITERATIONS})")  # fmt: skip
    window = result.baseline_nll["window"]
    if not math.isfinite(result.val_nll) or result.val_nll > window:
        problems.append(f"held-out NLL {result.val_nll:.3f} is worse than the pooled window's "
                        f"{window:.3f}")  # fmt: skip
    for key, label in (("runtime", "run-times"), ("order_stat", "x_(c)")):
        scores = (result.calibration or {}).get(key) or {}
        ks, count = scores.get("ks"), scores.get("count", 0)
        if ks is not None and ks > ks_bar(count):
            calibration.append(f"held-out PIT KS of {label} {ks:.3f} is above {ks_bar(count):.3f}")
    if not problems and not calibration:
        return None
    longest = max(run.shape[0] for run in runs)
    advice = f"profile longer (at least {max(PROFILE_ITERATIONS, 2 * longest)} iterations)"
    if not problems:
        return (
            f"the model is not calibrated on held-out data ({'; '.join(calibration)}) and is "
            f"marked uncalibrated: bdsgd plays its simple peers until the model's record beats "
            f"theirs; {advice} to calibrate it, or train with --policy ecdf",
            True,
        )
    return (
        f"the model is not calibrated on held-out data ({'; '.join(problems + calibration)}) "
        f"and is marked unusable: {advice}, or train with --policy ecdf",
        False,
    )


def _marked(fitted: Fitted, runs: list[RunMatrix]) -> Fitted:
    """``fitted`` with :func:`assess`'s verdict in its result and in its checkpoint's summary
    (``usable``, ``unusable_reason``, ``probation``: :attr:`Checkpoint.usable`)."""
    verdict = assess(fitted.result, runs, fitted.checkpoint.fit_config["holdout"])
    reason, probation = verdict if verdict is not None else (None, False)
    mark = {"usable": reason is None, "unusable_reason": reason, "probation": probation}
    ckpt = dataclasses.replace(fitted.checkpoint, summary={**fitted.checkpoint.summary, **mark})
    return Fitted(ckpt, dataclasses.replace(fitted.result, **mark))


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


def _refit(config: FitConfig, runs: list[RunMatrix], first: Fitted, bar: FitBar) -> Fitted:
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
        second = _fit(richer, runs, None, bar)
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


def _fit(
    config: FitConfig, runs: list[RunMatrix], prior: Checkpoint | None, bar: FitBar | None = None
) -> Fitted:
    """Train on the runs' heads, recalibrate and score on the held-out part; nothing saved."""
    began = time.perf_counter()
    if config.step_workers is None:  # the checkpoint records what the fit did
        config = dataclasses.replace(config, step_workers=auto_step_workers(runs))
    pyro.set_rng_seed(config.seed)
    pyro.clear_param_store()
    train_runs = [_head(r, split(r.shape[0], config.holdout)) for r in runs]
    if config.steps is None:
        config = dataclasses.replace(config, steps=auto_steps(train_runs))
    model, norm, vocab = _setup_model(config, train_runs, prior)
    rng = np.random.default_rng(config.seed)
    shown = train_runs + [policy_censored(r, rng) for r in train_runs if config.censor_copy]
    features = model.cfg.num_features
    stop = None
    if config.early_stop and config.holdout > 0:
        windows = stopping_windows(runs, config, lambda r: _tensors(r, norm, vocab, features))
        if scored_entries(windows) >= STOP_MIN_ENTRIES:
            every = max(STOP_MIN_EVERY, config.steps // STOP_CHECKS)
            stop = EarlyStop(windows, every=every, seed=config.seed)
    data = [_tensors(r, norm, vocab, features) for r in shown]
    losses = train(model, data, config, stop=stop, bar=bar)
    if bar is not None:
        bar.phase("score")
    ckpt = Checkpoint(model, norm, vocab, runs[-1].hosts, _plain(config), {})
    spans = recalibration_spans(runs, config.holdout)  # first half of the held-out part
    filtered = Filtered()  # both filter every run from its start to the held-out part
    common = common_slowdown(ckpt, runs, spans, seed=config.seed, filtered=filtered)
    ckpt = dataclasses.replace(ckpt, common=common)
    report = None
    if config.holdout > 0:  # calibration on the second half: neither trained nor recalibrated on
        report = evaluate(ckpt, runs, config.holdout, config.eval_samples, config.seed,
                          calibration_skip=0.5, filtered=filtered)  # fmt: skip
    taken = dataclasses.replace(config, steps=len(losses))
    ckpt = dataclasses.replace(ckpt, summary=_summary(taken, runs, report, ckpt.common))
    ckpt.summary["planned_steps"] = config.steps
    result = FitResult(
        steps=len(losses),
        val_nll=report.model if report else None,
        baseline_nll={"window": report.window, "ewma": report.ewma} if report else None,
        checkpoint=config.checkpoint,
        fit_s=time.perf_counter() - began,
        losses=losses,
        calibration=report.calibration if report else None,
        step_workers=config.step_workers,
        host_drops=model.cfg.recovery,
        host_regime=model.cfg.num_features == NUM_FEATURES,
        planned_steps=config.steps,
    )
    return Fitted(ckpt, result)


QUARTILE_ANCHOR_UP_TO = 16
"""Runs of at most this many workers are anchored at their first iteration's lower quartile
(:func:`anchor_quantile`)."""
AUTO_MIN_STEPS = 400
"""The fewest steps :func:`auto_steps` plans (up to a few thousand run-times): on a 4-rank
profile of 120 iterations, 200 steps left the predictive of the job's next run off (PIT KS
0.18 over its 480 run-times) where 400 did not (0.06), docs/decisions.md."""
AUTO_MAX_STEPS = 2000
"""The most it plans (about 50,000 run-times and more)."""
AUTO_STEPS_PER_ROOT = 9.0
"""Steps per square root of the training run-times (:func:`auto_steps`)."""


def anchor_quantile(runs: list[RunMatrix]) -> float:
    """The quantile of each run's first iteration the fit anchors it at: :data:`ANCHOR_Q` (the
    lower quartile) where every run has at most :data:`QUARTILE_ANCHOR_UP_TO` workers, else the
    median. Over a few ranks one rank's spell moves the median by a factor; over 32 and more
    the median is steady, and the quartile fitted the held-out clusters worse (`syn0` run-time
    KS 0.028 -> 0.060, `level-above` 0.032 -> 0.081; docs/decisions.md)."""
    small = max(run.shape[1] for run in runs) <= QUARTILE_ANCHOR_UP_TO
    return ANCHOR_Q if small else 0.5


def auto_steps(train_runs: list[RunMatrix]) -> int:
    """The steps a fit plans by default: :data:`AUTO_STEPS_PER_ROOT` times the square root of
    the run-times it trains on, within :data:`AUTO_MIN_STEPS` .. :data:`AUTO_MAX_STEPS`: more
    data holds more for the networks to learn, each step sees a batch of windows whatever the
    store's size."""
    entries = sum(int((r.present & np.isfinite(r.runtimes)).sum()) for r in train_runs)
    planned = round(AUTO_STEPS_PER_ROOT * math.sqrt(entries))
    return int(min(AUTO_MAX_STEPS, max(AUTO_MIN_STEPS, planned)))


STOP_CHECKS = 40
"""Checks of the stopping score over the planned steps (:class:`EarlyStop`) ..."""
STOP_MIN_EVERY = 10
"""... at most one every this many steps."""
STOP_PATIENCE = 5
"""Checks without an improvement of :data:`STOP_MIN_DELTA` after which the fit stops."""
STOP_MIN_DELTA = 0.002
"""Nats per run-time: a smaller improvement of the stopping score does not count."""
STOP_MAX_WINDOWS = 32
"""At most this many windows per run score a check."""
STOP_MIN_ENTRIES = 1000
"""Fewer run-times than this in the stopping span: no early stop (their ELBO is too noisy a
signal: on a 4-rank profile of 120 iterations, 48 run-times, it stopped fits at about 200
steps whose predictive of the job's next run was off)."""


def scored_entries(windows: list[tuple]) -> float:
    """The present run-times the stopping windows score."""
    return sum(float((batch.present.sum(-1) * mask).sum()) for batch, mask in windows)


def stopping_windows(runs: list[RunMatrix], config: FitConfig, tensors) -> list[tuple]:
    """(windows, mask) batches that score the stopping span of each run: the first half of its
    held-out part (:func:`recalibration_spans`), cut in blocks of half a window, each scored at
    the end of a window (up to ``config.window`` iterations) of what precedes it, so that the
    guide has filtered into it; with ``config.step_workers``, on a subsample of whole hosts
    drawn once, as a training step sees them. ``tensors``: a run -> its :class:`RunTensors`.
    The mask (B, L) is 1 at the scored iterations."""
    out = []
    for run, (begin, end) in zip(runs, recalibration_spans(runs, config.holdout), strict=True):
        if begin < 2 or end <= begin:
            continue
        data = tensors(_head(run, end))
        length = min(config.window, end)
        half = max(1, length // 2)
        blocks = list(range(begin, end, half))
        if len(blocks) > STOP_MAX_WINDOWS:
            blocks = [
                blocks[i] for i in np.linspace(0, len(blocks) - 1, STOP_MAX_WINDOWS, dtype=int)
            ]
        starts, mask = [], torch.zeros(len(blocks), length)
        for i, block in enumerate(blocks):
            last = min(block + half, end)
            first = max(0, last - length)  # (the window then runs past ``last``, unscored)
            starts.append(first)
            mask[i, block - first : last - first] = 1.0
        idx = torch.as_tensor(starts)[:, None] + torch.arange(length)[None, :]
        fields = {name: getattr(data, name)[idx] for name in PER_ENTRY}
        windows = dataclasses.replace(data, **fields)
        if config.step_workers:  # the hosts a step sees, drawn once: a check costs a step
            windows = subsample_hosts(windows, config.step_workers, np.random.default_rng(0))
        out.append((windows, mask))
    return out


class EarlyStop:
    """The stopping rule of a fit: every ``every`` steps, the negative ELBO per run-time of the
    stopping windows (:func:`stopping_windows`; :meth:`RuntimeModel.step_elbo` at the scored
    iterations, the guide's path drawn with a fixed seed, so that checks differ only by the
    weights); stop after :data:`STOP_PATIENCE` checks without an improvement of
    :data:`STOP_MIN_DELTA`; :meth:`restore` puts back the weights of the best check."""

    def __init__(self, windows: list[tuple], every: int, seed: int = 0) -> None:
        self.windows, self.every, self.seed = windows, every, seed
        self.scores: list[tuple[int, float]] = []
        self.best, self.best_state, self.improved_at = math.inf, None, 0

    def score(self, model: RuntimeModel) -> float:
        total, count = 0.0, 0.0
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            for batch, mask in self.windows:
                total += float((model.step_elbo(batch) * mask).sum())
                count += float((batch.present.sum(-1) * mask).sum())
        return -total / max(count, 1.0)

    def check(self, step: int, model: RuntimeModel) -> bool:
        """After ``step`` steps: whether to stop."""
        if not self.windows or step % self.every:
            return False
        score = self.score(model)
        self.scores.append((step, score))
        if score < self.best - STOP_MIN_DELTA:
            self.improved_at = step
        if score < self.best:
            self.best = score
            self.best_state = copy.deepcopy(model.state_dict())
        return step - self.improved_at >= STOP_PATIENCE * self.every

    def restore(self, model: RuntimeModel) -> None:
        if self.best_state is not None:
            model.load_state_dict(self.best_state)


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
        return (
            RuntimeModel(cfg),
            Normaliser.fit(train_runs, anchored=True, anchor_q=anchor_quantile(train_runs)),
            vocab,
        )
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


def train(
    model: RuntimeModel,
    data: list[RunTensors],
    config: FitConfig,
    stop: EarlyStop | None = None,
    bar: FitBar | None = None,
) -> list[float]:
    """SVI on random windows; returns the loss (negative ELBO per training entry) of each step
    taken: ``config.steps``, or fewer where ``stop`` says so (then with its best weights).

    Each step is what ``pyro.infer.SVI.step`` with ``TraceMeanField_ELBO`` does, written out:
    the ELBO's differentiable loss (:meth:`RuntimeModel.negative_elbo`, without Pyro's traces),
    its gradients, one optimizer step of every parameter, the gradients cleared. The model and
    guide use the module's parameters directly instead of registering them with ``pyro.module``
    at every call, and the same updates follow (the same losses to the last bit as Pyro's SVI,
    ``tests/stages/test_fit.py``). ``config.step_workers`` None is every worker here:
    :func:`run_fit` gives it its default (:func:`auto_step_workers`) first."""
    rng = np.random.default_rng(config.seed)
    optim = FusedClippedAdam(lr=config.lr, lrd=0.1 ** (1.0 / config.steps), clip_norm=10.0)
    params = [p for p in model.parameters() if p.requires_grad]
    losses: list[float] = []
    owned = bar is None
    bar = FitBar(config.progress).__enter__() if owned else bar
    bar.plan(config.steps)
    try:
        with pyro.validation_enabled(False):
            for step in range(1, config.steps + 1):
                batch = sample_windows(data, config.window, config.batch, rng)
                # step_workers None (run_fit resolves it by auto_step_workers): every worker
                batch = subsample_hosts(batch, config.step_workers or 0, rng)
                batch = _mask_unknown(batch, config.unknown_p, rng)
                loss = model.negative_elbo(batch)
                loss.backward()
                optim(params)
                for p in params:
                    p.grad = None
                losses.append(loss.item() / max(float(batch.present.sum()) * batch.weight, 1.0))
                bar.step(-float(np.mean(losses[-20:])))
                if stop is not None and stop.check(step, model):
                    break
        bar.unplan(config.steps - len(losses))
        if stop is not None:
            stop.restore(model)
    finally:
        if owned:
            bar.__exit__(None, None, None)
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


class FitBar:
    """The one progress bar of a fit, refit included, on stderr: the steps planned so far
    (:meth:`plan`, less those an early stop left untaken, :meth:`unplan`), the ELBO per entry
    and what the fit is doing (training, scoring on the held-out part)."""

    def __init__(self, enabled: bool) -> None:
        self.progress = Progress(
            TextColumn("[bold]fit"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[phase]} ELBO/entry {task.fields[elbo]:.3f}"),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
            transient=False,
        )
        self.task = None

    def __enter__(self) -> FitBar:
        self.progress.start()
        self.task = self.progress.add_task("fit", total=0, elbo=float("nan"), phase="train")
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def plan(self, steps: int) -> None:
        total = self.progress.tasks[0].total or 0
        self.progress.update(self.task, total=total + steps, phase="train")

    def unplan(self, steps: int) -> None:
        if steps:
            self.progress.update(self.task, total=self.progress.tasks[0].total - steps)

    def step(self, elbo: float) -> None:
        self.progress.update(self.task, advance=1, elbo=elbo)

    def phase(self, name: str) -> None:
        self.progress.update(self.task, phase=name)


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
