"""Run-time data as the model sees it: normalisation, history features and training windows.

Normalised log run-time: ``y = (log x - m) / s`` (kept in the checkpoint). A density in y converts
to seconds by the Jacobian ``log p(x) = log p(y) - log s - log x``; a survival probability needs
none. ``fit`` anchors every run at its own level: ``m`` is the run's **anchor**, the median log
run-time of its first observed iteration (:func:`run_anchor`; for runs of up to 16 workers
its lower quartile, :data:`ANCHOR_Q`), and ``s`` the spread of the
uncensored training log run-times about their runs' anchors. So the network sees every run
relative to how fast its first iteration was, and a run faster or slower than every fitted one
looks to it like the fitted ones: its level is read off its first iteration (with hundreds of
workers, exactly), not interpolated between fitted levels by weights that never saw it. Before a
run's first iteration the predictor has no anchor; it uses the checkpoint's ``m`` (the median of
the fitted runs' anchors) and draws the run's level about it with the spread of the fitted
anchors (``level_sd``). Checkpoints written before the anchor (``anchored`` False) normalise by
the median of all training log run-times, and the predictor keeps that.

History features of worker w before iteration t (deterministic functions of ``y_{<t}``, like
DeepAR's autoregressive inputs), computed by :class:`HistoryFilter`:

- ``e_t``: slow EWMA mean (alpha_slow) and ``v_t`` its EWMA variance: the ``ewma`` baseline;
- ``r_t``: fast EWMA mean (alpha_fast) minus ``e_t``: a regime change the slow mean lags behind;
- ``q_t``: the mean of ``r_t`` over the worker's host mates whose last value was seen exactly:
  host-correlated slowdowns (the workers a policy just cut off are the slowest of that
  iteration, so counting them would read every cut as a host slowing down);
- ``l_t``: the last value minus ``e_t`` (a step the EWMAs have not caught up with), split into
  ``l_t (1 - c_t)`` and ``max(l_t, 0) c_t`` with ``c_t`` the last value's censoring flag (a
  censored last value is its bound u, taken as it is where it says the worker is slower than
  thought: the model learns what a bound says), and ``|l_t| (1 - c_t)``;
- the median of the uncensored ``l_t`` over the worker's host and over all workers (robust to one
  worker's spike: a host's regime switch moves the host median, a spike does not);
- the position in the run (:data:`POSITION_FEATURES`): whether t is 1, 2 or 3, and
  ``(1 - alpha_slow)^t`` for t >= 1, the weight the slow EWMA still gives the run's first
  iteration; t counts the iterations with an entry before this one (a row of a trace where no
  worker has one, as an imported log numbered from 1 leaves, is none: ``simulate`` and a resumed
  ``train`` skip such rows, and the anchor is the first row with an entry). A job's first iterations are often slower or faster than its steady pace (warm-up,
  caches, autotuning), and every run is anchored at its first iteration, so the network needs to
  know how far into the run it is: the history features alone look the same at a window's start
  as at the run's. A fit's windows start anywhere in a run; these features do not depend on the
  window.

- the host's regime (:class:`RegimeFilter`, in models of :data:`NUM_FEATURES`): each host's slow
  spells filtered as a two-state chain from the host median of its workers' deviations from
  their calm means; the worker's expected location for the coming iteration (its calm mean
  plus its host's chance of a slow spell times the host's offset) minus ``e_t``, and that
  chance. The EWMAs read a host's regime linearly, so a calm host's noise moved every location
  with it; the filter moves a location by the whole offset when a host switches and hardly
  with a calm host's noise.

The censoring flags themselves are not features: whether a worker was cut off says as much about
the policy that chose c as about the worker, and a model that learnt "censored means slow" from
one policy's traces would talk another policy into waiting for ever fewer workers. The bound
``u`` says what the censoring says about the worker. The flags only decide whose values stand for
a host (``known``: seen exactly last time), in ``q_t``, the host median and the host's jump logit.

A censored value u (y >= u) is replaced by the truncated-normal mean
``E[y | y >= u] = e + sd phi(a) / Phi(-a)``, ``a = (u - e) / sd``, when u > e (the worker is slower than thought), and ignored when u <= e; missing entries
leave the state unchanged. The ``ewma`` baseline takes bounds down to e - sd: that is unbiased
while its belief is right, but each bound just below e pushes e up, so the workers a cutoff
policy keeps censoring drift towards "slow" and the policy waits for them ever less (a censoring
spiral, seen in replays where c collapsed to 2). Ignoring those bounds errs towards "fast",
which corrects itself: a worker thought fast is waited for, and then seen. For the same reason the censored last value enters the features only
when it lies above e: ``max(l_t, 0) c_t``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
from bdsgd.stages.store import RunMatrix

ALPHA_SLOW = 0.1
ALPHA_FAST = 0.5
BASE_FEATURES = 8
"""The history features of checkpoints written before the position features (their
``model_config`` has no ``num_features``)."""
POSITION_FEATURES = 4
REGIME_FEATURES = 2
NUM_FEATURES = BASE_FEATURES + POSITION_FEATURES + REGIME_FEATURES
DEFAULT_FEATURES = BASE_FEATURES + POSITION_FEATURES  # a fit's, without --host-regime
FEATURE_SETS = (BASE_FEATURES, DEFAULT_FEATURES, NUM_FEATURES)
"""The numbers of features a model can take: without the run position, with it, and with the
host regime's too (:class:`RegimeFilter`)."""
P_ENTER, P_LEAVE = 0.02, 0.1
""":class:`RegimeFilter`'s chances that a calm host turns slow, and a slow one calm, in an
iteration (fixed: what the features tell, the network weighs)."""


def check_num_features(num_features) -> int:
    """``num_features`` if it is one of :data:`FEATURE_SETS` (an int), else ValueError."""
    if type(num_features) is not int or num_features not in FEATURE_SETS:
        raise ValueError(f"num_features {num_features!r} is not one of {FEATURE_SETS}")
    return num_features


INIT_VAR = 0.25
MIN_VAR = 1e-4


@dataclass(frozen=True)
class Normaliser:
    """``y = (log x - loc) / scale``; ``anchored``: ``loc`` is replaced by each run's anchor
    once its first iteration is seen (the module docstring), and before that a run's level is
    drawn about ``loc``: ``level_sd`` times a Student's t with ``level_dof`` degrees of freedom
    (a normal for 0), normalised units."""

    loc: float
    scale: float
    anchored: bool = False
    level_sd: float = 0.0
    level_dof: int = 0  # t's degrees of freedom for the level before the anchor (0: a normal)
    anchor_q: float = 0.5  # the quantile of a run's first iteration it is anchored at

    @staticmethod
    def fit(runs: list[RunMatrix], anchored: bool = False, anchor_q: float = 0.5) -> Normaliser:
        """Unanchored: the median and spread of the uncensored log run-times of ``runs``.
        Anchored: the median of the runs' anchors (their first iterations' ``anchor_q``
        quantiles), the spread about each run's own anchor and the anchors' spread."""
        anchors = [run_anchor_of(r, anchor_q) if anchored else 0.0 for r in runs]
        logs = [
            np.log(r.runtimes[r.present & ~r.censored]) - a
            for r, a in zip(runs, anchors, strict=True)
        ]
        logs = np.concatenate(logs or [np.zeros(0)])
        if logs.size == 0:
            return Normaliser(0.0, 1.0, anchored)
        scale = max(float(np.std(logs)) if logs.size > 1 else 1.0, 1e-3)
        if not anchored:
            return Normaliser(float(np.median(logs)), scale)
        k, q = len(anchors), anchor_q
        if k < 2:
            return Normaliser(float(np.median(anchors)), scale, True, anchor_q=q)
        level_sd = float(np.std(anchors, ddof=1)) * math.sqrt(1.0 + 1.0 / k) / scale
        return Normaliser(float(np.median(anchors)), scale, True, level_sd, k - 1, q)

    def normalise(self, runtimes: np.ndarray) -> np.ndarray:
        return (np.log(runtimes) - self.loc) / self.scale

    def at(self, anchor: float) -> Normaliser:
        """This normalisation about a run's ``anchor`` (log seconds): the run's level is known."""
        return Normaliser(anchor, self.scale, self.anchored, anchor_q=self.anchor_q)

    def for_run(self, run: RunMatrix) -> Normaliser:
        """The normalisation of ``run``: about its anchor where anchored, else this one."""
        return self.at(run_anchor_of(run, self.anchor_q)) if self.anchored else self


ANCHOR_Q = 0.25
"""The quantile of a run's first iteration a fit anchors it at (:func:`run_anchor`). Not the
median: over a few ranks the median of one iteration moves with one rank's spell or a
persistently slow rank (4 ranks, one 2.5x slower: the mean of that rank and a fast one whenever
another is in a spell), and a fitted network reads levels about the anchor (its weight on the
slow EWMA). A 4-rank profile anchored 0.49 in log above its next run predicted that run 25% too
fast for all of its 120 iterations (docs/decisions.md); the lower quartile of the same two
first iterations differ by 0.02. ``fit`` takes it for runs of up to 16 workers (over more,
the median is steady and fitted the held-out clusters better: ``fit.anchor_quantile``);
checkpoints written before it anchor at the median."""


def run_anchor(runtimes: np.ndarray, present: np.ndarray, q: float = 0.5) -> float | None:
    """A run's anchor from one iteration: the ``q`` quantile of the log run-times of its present
    entries, a censored one at its bound (the bound is the cut, above every exact value, so the
    quantile is exact while fewer than 1 - q of them are censored); None when nothing is
    present. q = 0.5: the median, as checkpoints before :data:`ANCHOR_Q`."""
    x = np.asarray(runtimes, dtype=float)[np.asarray(present, dtype=bool)]
    x = x[np.isfinite(x) & (x > 0)]
    return float(np.quantile(np.log(x), q)) if x.size else None


def run_anchor_of(run: RunMatrix, q: float = 0.5) -> float:
    """The anchor of a run: :func:`run_anchor` of its first iteration with a present entry."""
    for t in range(run.shape[0]):
        anchor = run_anchor(run.runtimes[t], run.present[t], q)
        if anchor is not None:
            return anchor
    return 0.0


def host_groups(hosts: list[str] | tuple[str, ...]) -> torch.Tensor:
    """(N,) long: index of each worker's host among the distinct hosts of this worker set."""
    names = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    return torch.tensor([names[h] for h in hosts], dtype=torch.long)


def group_table(groups: torch.Tensor) -> torch.Tensor:
    """(G, M) long: the workers of each group, padded with N (a slot that is always NaN)."""
    n = groups.numel()
    num = int(groups.max()) + 1 if n else 0
    members = [torch.nonzero(groups == g).flatten() for g in range(num)]
    width = max((m.numel() for m in members), default=0)
    table = torch.full((num, width), n, dtype=torch.long)
    for g, m in enumerate(members):
        table[g, : m.numel()] = m
    return table


def group_median(values: torch.Tensor, valid: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(N,) -> (G,) median of the valid values of each group (0 for a group with none)."""
    padded = torch.cat([torch.where(valid, values, torch.nan), values.new_full((1,), torch.nan)])
    return torch.nanmedian(padded[table], dim=-1).values.nan_to_num(0.0)


class RegimeFilter:
    """Each host's slow spells, filtered as a two-state chain: calm, or slow by an offset
    ``delta`` (normalised units), entering and leaving at :data:`P_ENTER` and :data:`P_LEAVE`.
    Each iteration it reads the host median of its exactly seen workers' deviations from their
    calm means (robust to one worker's spike), weighs it under both states (normal, with the
    host's calm spread ``var`` learnt from the calm iterations) and updates the host's chance
    of being slow by Bayes. Each worker's calm mean follows its values weighted by the chance
    its host was calm (an EWMA that a slow spell does not drag up), and a slow host's offset
    follows its deviations. So the expected location of a worker, its calm mean plus its host's
    chance of a slow spell times the offset, moves by the whole offset when a host turns slow or
    recovers, and hardly at all with the noise of a calm host (what a linear read of the host
    averages of the EWMAs did: docs/benchmarks.md, "The model's draws against the true
    predictive"). O(N) per iteration."""

    def __init__(self, groups: torch.Tensor, table: torch.Tensor):
        n, g = groups.numel(), table.shape[0]
        self.groups, self.table = groups, table
        self.calm = torch.zeros(n)  # each worker's mean while its host is calm
        self.p_slow = torch.zeros(g)  # each host's chance of a slow spell, after the last value
        self.delta = torch.ones(g)  # a slow host's offset from its calm means
        self.var = torch.full((g,), 0.1)  # the spread of a calm host's median deviation

    def features(self, slow: torch.Tensor, seen: torch.Tensor) -> list[torch.Tensor]:
        """[expected location - the slow EWMA, the host's chance of a slow spell], both for
        the coming iteration, per worker (0 before its first value)."""
        ahead = self.ahead()
        expected = self.calm + (ahead * self.delta)[self.groups]
        return [(expected - slow) * seen, ahead[self.groups] * seen]

    def ahead(self) -> torch.Tensor:
        """(G,) each host's chance of a slow spell at the coming iteration (the chain's step)."""
        return self.p_slow * (1 - P_LEAVE) + (1 - self.p_slow) * P_ENTER

    def update(self, y: torch.Tensor, exact: torch.Tensor, first: torch.Tensor) -> None:
        """Fold in one iteration: ``exact`` the workers seen exactly (not for the first time:
        ``first`` starts a worker's calm mean at its value)."""
        self.calm = torch.where(first, y, self.calm)
        d = y - self.calm
        d_host = group_median(d, exact, self.table)
        has = torch.zeros(self.table.shape[0]).index_add_(0, self.groups, exact.float()) > 0
        prior = self.ahead()
        log_calm = -0.5 * d_host**2 / self.var
        log_slow = -0.5 * (d_host - self.delta) ** 2 / self.var
        odds = torch.exp((log_slow - log_calm).clamp(-60.0, 60.0)) * prior / (1 - prior)
        self.p_slow = torch.where(has, odds / (1 + odds), prior)
        calm_host = has & (self.p_slow < 0.5)
        var = self.var + ALPHA_SLOW * (d_host**2 - self.var)
        self.var = torch.where(calm_host, var, self.var).clamp(min=0.01)
        delta = (self.delta + 0.2 * (d_host - self.delta)).clamp(min=0.5)
        self.delta = torch.where(has & ~calm_host, delta, self.delta)
        step = torch.where(exact, (1 - self.p_slow)[self.groups] * d, torch.zeros_like(d))
        self.calm = self.calm + ALPHA_SLOW * step


class HistoryFilter:
    """Per-worker EWMA state over normalised log run-times; O(N) per iteration."""

    def __init__(self, groups: torch.Tensor, num_features: int = DEFAULT_FEATURES):
        n = groups.numel()
        self.position = check_num_features(num_features) > BASE_FEATURES
        self.steps = 0  # iterations with an entry folded in: the next one's position in the run
        self.groups = groups
        self.table = group_table(groups)
        self.all = torch.arange(n + 1).unsqueeze(0)
        self.slow = torch.zeros(n)
        self.fast = torch.zeros(n)
        self.last = torch.zeros(n)
        self.last_censored = torch.zeros(n)
        self.var = torch.full((n,), INIT_VAR)
        self.seen = torch.zeros(n, dtype=torch.bool)
        self.regime = RegimeFilter(groups, self.table) if num_features == NUM_FEATURES else None

    def _host_mean(self, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        count = torch.zeros(self.table.shape[0]).index_add_(0, self.groups, valid.float())
        total = torch.zeros(self.table.shape[0]).index_add_(0, self.groups, values * valid)
        return (total / count.clamp(min=1.0))[self.groups]

    def features(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(e, sd, f, k): slow mean (N,), spread (N,), features (N, F) =
        [r, q, e, l (1 - c), l c, |l| (1 - c), l_host, l_all] and, with the position,
        [t == 1, t == 2, t == 3, (1 - alpha_slow)^t (t >= 1)] and, with the host regime,
        [expected location - e, P(host slow)] (:class:`RegimeFilter`; see the module
        docstring), and ``known`` (N,) bool: the worker's last value was seen exactly."""
        r = (self.fast - self.slow) * self.seen
        lag = (self.last - self.slow) * self.seen
        cens = self.last_censored
        exact = lag * (1 - cens)
        known = self.seen & (cens == 0)
        l_host = group_median(lag, known, self.table)[self.groups]
        l_all = group_median(lag, known, self.all).expand_as(lag)
        feats = [
            r,
            self._host_mean(r, known),
            self.slow,
            exact,
            lag.clamp(min=0) * cens,
            exact.abs(),
            l_host,
            l_all,
        ]
        if self.position:
            feats += [lag.new_full(lag.shape, v) for v in position_features(self.steps)]
        if self.regime is not None:
            feats += self.regime.features(self.slow, self.seen)
        return self.slow, self.var.sqrt(), torch.stack(feats, dim=-1), known

    def update(self, y: torch.Tensor, censored: torch.Tensor, present: torch.Tensor) -> None:
        """Fold in one iteration of normalised log run-times (see the module docstring)."""
        first = present & ~censored & ~self.seen
        self.slow = torch.where(first, y, self.slow)
        self.fast = torch.where(first, y, self.fast)
        self.seen = self.seen | first
        sd = self.var.sqrt()
        a = (y - self.slow) / sd
        log_phi = -0.5 * a**2 - 0.5 * math.log(2 * math.pi)
        truncated = self.slow + sd * torch.exp(log_phi - torch.special.log_ndtr(-a))
        target = torch.where(censored, truncated, y)
        seen_now = present & self.seen
        self.last = torch.where(seen_now, y, self.last)
        self.last_censored = torch.where(seen_now, censored.float(), self.last_censored)
        use = seen_now & ~first & (~censored | (a > 0.0))
        diff = torch.where(use, target - self.slow, torch.zeros_like(y))
        self.slow = self.slow + ALPHA_SLOW * diff
        var = (1 - ALPHA_SLOW) * (self.var + ALPHA_SLOW * diff**2)
        self.var = torch.where(use, var, self.var).clamp(min=MIN_VAR)
        self.fast = torch.where(use, self.fast + ALPHA_FAST * (target - self.fast), self.fast)
        if self.regime is not None and present.any():  # (a row with no entry is no iteration)
            self.regime.update(y, seen_now & ~first & ~censored, first)
        self.steps += int(bool(present.any()))  # a row with no entry is no iteration of the run


def position_features(t: int) -> tuple[float, ...]:
    """The :data:`POSITION_FEATURES` of the run's iteration ``t`` (0 first): all 0 at t = 0."""
    decay = (1.0 - ALPHA_SLOW) ** t if t >= 1 else 0.0
    return float(t == 1), float(t == 2), float(t == 3), decay


@dataclass(frozen=True)
class RunTensors:
    """One run, normalised, with its causal history features; all (T, N[, F]) float32/bool."""

    y: torch.Tensor
    censored: torch.Tensor
    present: torch.Tensor
    ewma: torch.Tensor
    sd: torch.Tensor
    feats: torch.Tensor
    known: torch.Tensor
    """(T, N) bool: the worker's last value before iteration t was seen exactly."""
    worker_idx: torch.Tensor
    host_idx: torch.Tensor
    groups: torch.Tensor
    """(N,) long: each worker's host among this run's distinct hosts (:func:`host_groups`)."""
    weight: float = 1.0
    """What the likelihood of these workers stands for: G / g when a fit step sees g of the
    run's G hosts (:func:`subsample_hosts`), else 1."""


PER_ENTRY = ("y", "censored", "present", "ewma", "sd", "feats", "known")
"""The fields of :class:`RunTensors` with an entry per iteration and worker ((T, N[, F]))."""


def run_history(
    y: torch.Tensor,
    censored: torch.Tensor,
    present: torch.Tensor,
    groups: torch.Tensor,
    num_features: int = DEFAULT_FEATURES,
) -> tuple[torch.Tensor, ...]:
    """History features before each iteration: e (T, N), sd (T, N), f (T, N, F), known (T, N)."""
    hist = HistoryFilter(groups, num_features)
    outs: tuple[list[torch.Tensor], ...] = ([], [], [], [])
    for t in range(y.shape[0]):
        for out, value in zip(outs, hist.features(), strict=True):
            out.append(value)
        hist.update(y[t], censored[t], present[t])
    return tuple(torch.stack(out) for out in outs)


def to_tensors(
    run: RunMatrix,
    norm: Normaliser,
    worker_idx: torch.Tensor,
    host_idx: torch.Tensor,
    num_features: int = DEFAULT_FEATURES,
) -> RunTensors:
    """Normalise a run (about its anchor where ``norm`` is anchored; missing entries: y = 0,
    present = False) and compute its ``num_features`` features (the model's)."""
    norm = norm.for_run(run)
    present = torch.as_tensor(run.present & np.isfinite(run.runtimes))
    raw = np.where(present.numpy(), run.runtimes, 1.0)
    y = torch.as_tensor(norm.normalise(raw), dtype=torch.float32) * present
    censored = torch.as_tensor(run.censored) & present
    groups = host_groups(run.hosts)
    e, sd, f, known = run_history(y, censored, present, groups, num_features)
    return RunTensors(y, censored, present, e, sd, f, known, worker_idx, host_idx, groups)


def subsample_hosts(batch: RunTensors, workers: int, rng: np.random.Generator) -> RunTensors:
    """The windows of ``batch`` on g of its G hosts, drawn at random without replacement, whole
    hosts (a host's slow spell is one term of the likelihood), g = ``workers`` / the mean host
    size (at least 1); ``weight`` G / g makes the likelihood, for a given path of z, an
    unbiased estimate of all the hosts'. The guide's encoder pools over the hosts drawn, so the
    path is drawn given them and the step's ELBO is an approximation of the whole one, not an
    unbiased estimate (the predictor's encoder pools over every worker). Unchanged (and no
    draw taken) when ``workers`` is 0, the run has no more workers than that, or the run's
    workers are all on one host."""
    n = batch.groups.numel()
    if workers <= 0 or n <= workers:
        return batch
    num_hosts = int(batch.groups.max()) + 1
    g = max(1, round(workers * num_hosts / n))
    if g >= num_hosts:
        return batch
    chosen = torch.as_tensor(np.sort(rng.choice(num_hosts, g, replace=False)))
    cols = torch.nonzero(torch.isin(batch.groups, chosen)).flatten()
    return dataclasses.replace(
        batch,
        **{name: getattr(batch, name)[:, :, cols] for name in PER_ENTRY},
        worker_idx=batch.worker_idx[cols],
        host_idx=batch.host_idx[cols],
        groups=torch.unique(batch.groups[cols], return_inverse=True)[1],
        weight=num_hosts / g,
    )


def sample_windows(
    runs: list[RunTensors], window: int, batch: int, rng: np.random.Generator
) -> RunTensors:
    """``batch`` windows of ``window`` iterations from one run drawn in proportion to its size;
    fields become (B, L, N[, F]); index fields stay (N,)."""
    sizes = np.array([r.y.shape[0] * r.y.shape[1] for r in runs], dtype=float)
    run = runs[rng.choice(len(runs), p=sizes / sizes.sum())]
    length = min(window, run.y.shape[0])
    starts = torch.as_tensor(rng.integers(0, run.y.shape[0] - length + 1, size=batch))
    idx = starts[:, None] + torch.arange(length)[None, :]
    return dataclasses.replace(run, **{name: getattr(run, name)[idx] for name in PER_ENTRY})
