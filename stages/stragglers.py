"""Injected stragglers: per-(iteration, worker) delays added on top of real computation.

Specs (``--stragglers``):

- ``none``: real contention only.
- ``synthetic[:key=value,...]``: a synthetic cluster (:class:`SyntheticCluster`): workers spread
  over emulated hosts; each host switches between a normal and a slow regime (a Markov chain, so
  slowdowns come and go and hit every worker of the host together); the whole cluster drifts
  slowly; every delay has log-normal noise and rare heavy-tailed (Pareto) spikes.
- ``replay:PATH``: the run-times of a schema-v1 trace store or Parquet file. Worker w plays trace
  worker ``w mod N'`` and iteration t plays ``t mod T'`` of the trace's first run.
- ``job[:PRESET][:key=value,...]``: a user's job (:class:`JobCluster`): every rank's emulated
  device time per step, persistently slow ranks (from some iteration on), and transient slow
  spells of a rank or of a whole host. Presets (:data:`JOB_PRESETS`): ``slow_rank`` (the
  default), ``two_slow``, ``host_spells``, ``late_slowdown``.

``--time-scale`` multiplies every delay (e.g. 0.01 turns a 1 s cluster into 10 ms).

A worker process plays one column of the (T, N) delays: ``model.column(T, N, w)`` computes it as
it is read (indexable by iteration, with a length), so a run of any length costs a worker memory
for a block of iterations, not for T x N.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from bdsgd.stages.errors import ConfigError, TraceError


@dataclass(frozen=True, kw_only=True)
class SyntheticCluster:
    """A drifting cluster with host-correlated slow regimes and heavy-tailed spikes."""

    base_s: float = 0.02
    """Median delay of a healthy worker, seconds."""
    hosts: int = 4
    """Emulated hosts; worker w lives on host ``w mod hosts``."""
    worker_spread: float = 0.15
    """Std. dev. of the per-worker log speed factor (some machines are simply slower)."""
    sigma: float = 0.15
    """Std. dev. of per-iteration log-normal noise."""
    slow_factor: float = 3.0
    """Multiplier on every worker of a host while that host is in its slow regime."""
    p_slow: float = 0.01
    """Per-iteration probability that a healthy host turns slow."""
    p_recover: float = 0.05
    """Per-iteration probability that a slow host recovers."""
    drift: float = 0.3
    """Amplitude of the slow cluster-wide drift of log delay."""
    drift_period: int = 400
    """Period of that drift, iterations."""
    spike_p: float = 0.01
    """Probability of a heavy-tailed spike per (iteration, worker)."""
    spike_alpha: float = 1.5
    """Pareto tail index of spikes (smaller: heavier)."""
    slow_workers: int = 0
    """Workers 0..slow_workers-1 are persistently slow: every delay times ``slow_worker_factor``."""
    slow_worker_factor: float = 2.0
    """How much slower a persistently slow worker is."""
    seed: int = 0

    def __post_init__(self) -> None:
        numbers = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if bad := [k for k, v in numbers.items() if not math.isfinite(v)]:
            raise ConfigError(f"synthetic stragglers: {', '.join(bad)} must be finite")
        if self.base_s <= 0 or self.hosts < 1 or self.slow_factor < 1:
            raise ConfigError("synthetic stragglers need base_s > 0, hosts >= 1, slow_factor >= 1")
        for name in ("p_slow", "p_recover", "spike_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"synthetic stragglers: {name} must be in [0, 1]")
        if self.slow_workers < 0 or self.slow_worker_factor < 1:
            raise ConfigError(
                "synthetic stragglers need slow_workers >= 0, slow_worker_factor >= 1"
            )
        if self.drift_period < 1 or self.spike_alpha <= 0:
            raise ConfigError("synthetic stragglers need drift_period >= 1 and spike_alpha > 0")

    def host_of(self, workers: int) -> list[str]:
        return [f"host{w % self.hosts}" for w in range(workers)]

    def host_regimes(self, iterations: int, rng: np.random.Generator) -> np.ndarray:
        """(T, hosts) bool: True where the host is in its slow regime."""
        slow = np.zeros((iterations, self.hosts), dtype=bool)
        state = np.zeros(self.hosts, dtype=bool)
        u = rng.random((iterations, self.hosts))
        for t in range(iterations):
            state = np.where(state, u[t] >= self.p_recover, u[t] < self.p_slow)
            slow[t] = state
        return slow

    def delays(self, iterations: int, workers: int) -> np.ndarray:
        """(T, N) delays in seconds; the same for the same seed, whatever process asks (and
        equal to the :meth:`column` of each worker)."""
        if iterations * workers <= MATRIX_CELLS:
            return np.exp(self.log_delays(iterations, workers).sum(axis=0))
        cols = [self.column(iterations, workers, w) for w in range(workers)]
        return np.stack([c.values(0, iterations) for c in cols], axis=1)

    def column(self, iterations: int, workers: int, w: int) -> Column:
        """Worker w's delays. Up to :data:`MATRIX_CELLS` cells this is the column of
        :meth:`log_delays`' matrix; beyond, a :class:`SyntheticColumn`, drawn block by block
        from per-(worker, block) and per-(host, block) streams as it is read."""
        if iterations * workers <= MATRIX_CELLS:
            return ArrayColumn(self.delays(iterations, workers)[:, w])
        return SyntheticColumn(self, iterations, w)

    def log_delays(self, iterations: int, workers: int) -> np.ndarray:
        """The (5, T, N) terms whose sum is the log delay: base and worker speed, drift, the host
        regime, noise, spikes. Kept apart so a benchmark can build the true predictive."""
        rng = np.random.default_rng(self.seed)
        host = np.arange(workers) % self.hosts
        terms = np.zeros((5, iterations, workers))
        terms[0] = np.log(self.base_s) + rng.normal(0, self.worker_spread, workers)[None, :]
        terms[0, :, : self.slow_workers] += np.log(self.slow_worker_factor)
        t = np.arange(iterations)[:, None]
        terms[1] = self.drift * np.sin(2 * np.pi * t / self.drift_period + rng.uniform(0, 6.3))
        terms[2] = np.log(self.slow_factor) * self.host_regimes(iterations, rng)[:, host]
        terms[3] = rng.normal(0, self.sigma, (iterations, workers))
        spikes = rng.random((iterations, workers)) < self.spike_p
        terms[4] = spikes * np.log(rng.pareto(self.spike_alpha, (iterations, workers)) + 1.0)
        return terms


@dataclass(frozen=True, kw_only=True)
class JobCluster:
    """A user's data-parallel job: each rank's step is ``micro_batches`` micro-batches of
    ``device_s`` seconds each, times ``slow_factor`` for the persistently slow ranks (ranks
    0..slow_ranks-1, from iteration ``slow_from`` on), times a log-normal jitter, plus a spell of
    ``spell_s`` seconds with probability ``spell_p`` per rank and step (per host and step with
    ``host_spells``: every rank of the host at once). The library path waits each step's delay
    out spread over the rank's micro-batches, so a spell is spread over them too.

    The draws of (rank, block of iterations) and (host, block) come from their own streams, so
    a delay is the same whatever the run's length or the process that asks."""

    device_s: float = 0.04
    """Emulated device time of one micro-batch on a healthy rank, seconds."""
    micro_batches: int = 4
    """Micro-batches per step."""
    hosts: int = 1
    """Emulated hosts; rank w lives on host ``w mod hosts``."""
    slow_ranks: int = 1
    """Ranks 0..slow_ranks-1 are persistently slow."""
    slow_factor: float = 2.5
    """How much slower a persistently slow rank computes."""
    slow_from: int = 0
    """The iteration from which the slow ranks are slow (before it they are healthy)."""
    spell_s: float = 0.6
    """Length of a transient slow spell, seconds (added to the step)."""
    spell_p: float = 0.08
    """Probability of a spell per rank and step (per host and step with ``host_spells``)."""
    host_spells: bool = False
    """A spell hits every rank of a host together."""
    sigma: float = 0.05
    """Std. dev. of the per-step log-normal jitter of the device time."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) for v in (self.device_s, self.slow_factor, self.spell_s,
                                              self.spell_p, self.sigma)):  # fmt: skip
            raise ConfigError("job stragglers: every parameter must be finite")
        if self.device_s <= 0 or self.micro_batches < 1 or self.hosts < 1:
            raise ConfigError("job stragglers need device_s > 0, micro_batches >= 1, hosts >= 1")
        if self.slow_ranks < 0 or self.slow_factor < 1 or self.slow_from < 0:
            raise ConfigError(
                "job stragglers need slow_ranks >= 0, slow_factor >= 1, slow_from >= 0"
            )
        if self.spell_s < 0 or not 0.0 <= self.spell_p <= 1.0 or self.sigma < 0:
            raise ConfigError("job stragglers need spell_s >= 0, spell_p in [0, 1], sigma >= 0")

    @property
    def step_s(self) -> float:
        """A healthy rank's median step, seconds."""
        return self.device_s * self.micro_batches

    def host_of(self, workers: int) -> list[str]:
        return [f"host{w % self.hosts}" for w in range(workers)]

    def delays(self, iterations: int, workers: int) -> np.ndarray:
        """(T, N) delays in seconds (each rank's :meth:`column`)."""
        cols = [self.column(iterations, workers, w) for w in range(workers)]
        return np.stack([c.values(0, iterations) for c in cols], axis=1).reshape(iterations, -1)

    def column(self, iterations: int, workers: int, w: int) -> Column:
        return JobColumn(self, iterations, w)


JOB_PRESETS: dict[str, dict] = {
    "slow_rank": {},
    "two_slow": {"slow_ranks": 2},
    "host_spells": {"hosts": 2, "host_spells": True},
    "late_slowdown": {"slow_from": 100},
}
"""``job:PRESET``: one rank 2.5x slower and rank spells of 0.6 s with probability 0.08
(``slow_rank``); two slow ranks (``two_slow``); spells on a whole host of two (``host_spells``);
the slow rank healthy until iteration 100 (``late_slowdown``)."""


@dataclass(frozen=True)
class ReplayCluster:
    """Delays taken from a recorded trace (its first run, or the run named ``run_id``)."""

    runtimes: np.ndarray
    hosts_: tuple[str, ...]

    def host_of(self, workers: int) -> list[str]:
        n = len(self.hosts_)
        return [self.hosts_[w % n] for w in range(workers)]

    def delays(self, iterations: int, workers: int) -> np.ndarray:
        t_src, n_src = self.runtimes.shape
        rows = np.arange(iterations) % t_src
        cols = np.arange(workers) % n_src
        return self.runtimes[np.ix_(rows, cols)]

    def column(self, iterations: int, workers: int, w: int) -> Column:
        """Worker w's delays: trace worker ``w mod N'`` at iteration ``t mod T'``."""
        return ArrayColumn(self.runtimes[:, w % self.runtimes.shape[1]], iterations)


@dataclass(frozen=True)
class NoStragglers:
    def host_of(self, workers: int) -> list[str] | None:
        return None

    def delays(self, iterations: int, workers: int) -> np.ndarray:
        return np.zeros((iterations, workers))

    def column(self, iterations: int, workers: int, w: int) -> Column:
        return ArrayColumn(np.zeros(1), iterations)


@dataclass(frozen=True)
class Scaled:
    """Any straggler model with its delays multiplied by ``scale``."""

    inner: SyntheticCluster | ReplayCluster | NoStragglers
    scale: float

    def host_of(self, workers: int) -> list[str] | None:
        return self.inner.host_of(workers)

    def delays(self, iterations: int, workers: int) -> np.ndarray:
        return self.inner.delays(iterations, workers) * self.scale

    def column(self, iterations: int, workers: int, w: int) -> Column:
        return ScaledColumn(self.inner.column(iterations, workers, w), self.scale)


# -- one worker's column of delays ------------------------------------------------------------
MATRIX_CELLS = 1 << 20
"""Largest T x N drawn as one matrix (what every worker then holds 5 x of, briefly)."""
BLOCK = 4096
"""Iterations a :class:`SyntheticColumn` draws at once."""


class Column:
    """One worker's delays of a T-iteration run: ``column[t]`` for 0 <= t < ``len(column)``."""

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, t: int) -> float:
        if not 0 <= t < self.length:
            raise IndexError(f"iteration {t} outside 0..{self.length - 1}")
        return self.at(int(t))

    def values(self, start: int, stop: int) -> np.ndarray:
        return np.array([self.at(t) for t in range(start, stop)])


class ArrayColumn(Column):
    """``values[t mod len(values)]`` for a run of ``length`` iterations (default: one pass)."""

    def __init__(self, values: np.ndarray, length: int | None = None) -> None:
        self.array = np.asarray(values, dtype=float)
        self.length = len(self.array) if length is None else length

    def at(self, t: int) -> float:
        return float(self.array[t % len(self.array)])


class ScaledColumn(Column):
    def __init__(self, inner: Column, scale: float) -> None:
        self.inner, self.scale, self.length = inner, scale, len(inner)

    def at(self, t: int) -> float:
        return self.inner.at(t) * self.scale

    def values(self, start: int, stop: int) -> np.ndarray:
        return self.inner.values(start, stop) * self.scale


class SyntheticColumn(Column):
    """Worker w's delays of a long :class:`SyntheticCluster` run, drawn :data:`BLOCK`
    iterations at a time. Worker speed, noise and spikes come from streams keyed by (seed, worker,
    block); a host's slow regime is a Markov chain per (seed, host, block), so workers of a host
    are slow together here too."""

    def __init__(self, cluster: SyntheticCluster, iterations: int, w: int) -> None:
        self.cluster, self.length, self.w = cluster, iterations, w
        self.host = w % cluster.hosts
        rng = np.random.default_rng([cluster.seed, 0, w])
        self.speed = np.log(cluster.base_s) + rng.normal(0, cluster.worker_spread)
        if w < cluster.slow_workers:
            self.speed += np.log(cluster.slow_worker_factor)
        self.phase = np.random.default_rng([cluster.seed, 1]).uniform(0, 6.3)
        self.block, self.cached = -1, np.zeros(0)

    def at(self, t: int) -> float:
        if t // BLOCK != self.block:
            self.block = t // BLOCK
            self.cached = self.draw(self.block)
        return float(self.cached[t % BLOCK])

    def values(self, start: int, stop: int) -> np.ndarray:
        blocks = range(start // BLOCK, (stop - 1) // BLOCK + 1)
        out = np.concatenate([self.draw(b) for b in blocks])
        return out[start - blocks[0] * BLOCK : stop - blocks[0] * BLOCK]

    def draw(self, b: int) -> np.ndarray:
        c = self.cluster
        t = np.arange(b * BLOCK, (b + 1) * BLOCK)
        rng = np.random.default_rng([c.seed, 3, self.w, b])
        noise = rng.normal(0, c.sigma, BLOCK)
        spikes = (rng.random(BLOCK) < c.spike_p) * np.log(rng.pareto(c.spike_alpha, BLOCK) + 1)
        drift = c.drift * np.sin(2 * np.pi * t / c.drift_period + self.phase)
        slow = np.log(c.slow_factor) * self.regimes(b)
        return np.exp(self.speed + drift + slow + noise + spikes)

    def regimes(self, b: int) -> np.ndarray:
        """(BLOCK,) bool: the host's slow regime in block b, a chain that enters the block in
        its stationary distribution (so any block is drawn without the ones before it)."""
        c = self.cluster
        rng = np.random.default_rng([c.seed, 2, self.host, b])
        stationary = c.p_slow / (c.p_slow + c.p_recover) if c.p_slow + c.p_recover else 0.0
        state = rng.random() < stationary
        out = np.empty(BLOCK, dtype=bool)
        for i, x in enumerate(rng.random(BLOCK)):
            state = x >= c.p_recover if state else x < c.p_slow
            out[i] = state
        return out


class JobColumn(Column):
    """Rank w's delays of a :class:`JobCluster`, drawn :data:`BLOCK` iterations at a time."""

    def __init__(self, job: JobCluster, iterations: int, w: int) -> None:
        self.job, self.length, self.w = job, iterations, w
        self.host = w % job.hosts
        self.block, self.cached = -1, np.zeros(0)

    def at(self, t: int) -> float:
        if t // BLOCK != self.block:
            self.block = t // BLOCK
            self.cached = self.draw(self.block)
        return float(self.cached[t % BLOCK])

    def values(self, start: int, stop: int) -> np.ndarray:
        if stop <= start:
            return np.zeros(0)
        blocks = range(start // BLOCK, (stop - 1) // BLOCK + 1)
        out = np.concatenate([self.draw(b) for b in blocks])
        return out[start - blocks[0] * BLOCK : stop - blocks[0] * BLOCK]

    def draw(self, b: int) -> np.ndarray:
        job = self.job
        t = np.arange(b * BLOCK, (b + 1) * BLOCK)
        rng = np.random.default_rng([job.seed, 5, self.w, b])
        step = job.step_s * np.exp(job.sigma * rng.standard_normal(BLOCK))
        if self.w < job.slow_ranks:
            step = np.where(t >= job.slow_from, step * job.slow_factor, step)
        spells = rng.random(BLOCK)
        if job.host_spells:
            spells = np.random.default_rng([job.seed, 6, self.host, b]).random(BLOCK)
        return step + job.spell_s * (spells < job.spell_p)


def parse_stragglers(spec: str, seed: int = 0, time_scale: float = 1.0) -> Scaled:
    """Turn a ``--stragglers`` spec into a model. Raises ConfigError/TraceError on bad specs."""
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ConfigError(f"--time-scale must be a finite number > 0, got {time_scale}")
    kind, _, arg = spec.partition(":")
    if kind == "none" and not arg:
        return Scaled(NoStragglers(), time_scale)
    if kind == "synthetic":
        return Scaled(SyntheticCluster(seed=seed, **_parse_params(arg)), time_scale)
    if kind == "replay":
        if not arg:
            raise ConfigError("--stragglers replay:PATH needs a path")
        return Scaled(load_replay(arg), time_scale)
    if kind == "job":
        return Scaled(parse_job(arg, seed), time_scale)
    raise ConfigError(
        f"unknown --stragglers spec {spec!r} (none, synthetic[:k=v,...], replay:PATH, "
        f"job[:PRESET][:k=v,...])"
    )


def parse_job(arg: str, seed: int = 0) -> JobCluster:
    """``job``'s argument: an optional preset name (:data:`JOB_PRESETS`), then ``key=value``
    pairs that override it, separated by commas or colons."""
    items = [item for item in arg.replace(":", ",").split(",") if item]
    params = dict(JOB_PRESETS["slow_rank"])
    if items and "=" not in items[0]:
        name = items.pop(0)
        if name not in JOB_PRESETS:
            raise ConfigError(f"unknown job preset {name!r} (known: {', '.join(JOB_PRESETS)})")
        params = dict(JOB_PRESETS[name])
    params.update(_parse_params(",".join(items), JobCluster, "job"))
    return JobCluster(seed=seed, **params)


def _parse_params(arg: str, cls: type = SyntheticCluster, kind: str = "synthetic") -> dict:
    """``key=value,...`` to the fields of ``cls`` (ints, floats, and for a bool field 0/1 or
    true/false); ``seed`` comes from ``--seed``, never from the spec."""
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    params: dict = {}
    for item in filter(None, arg.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in fields or key == "seed":
            known = ", ".join(k for k in fields if k != "seed")
            raise ConfigError(f"bad {kind} straggler parameter {item!r} (known: {known})")
        try:
            params[key] = _number(value, fields[key])
        except ValueError:
            raise ConfigError(
                f"{kind} straggler parameter {key} needs a number, got {value!r}"
            ) from None
    return params


def _number(value: str, kind) -> int | float | bool:
    if kind in ("bool", bool):
        if value.lower() not in ("0", "1", "true", "false"):
            raise ValueError(value)
        return value.lower() in ("1", "true")
    return int(value) if kind in ("int", int) else float(value)


def load_replay(path: str) -> ReplayCluster:
    """Read the first run of a schema-v1 trace (store directory or file) for replay."""
    from bdsgd.stages.store import read_trace_path, to_run_matrix

    df = read_trace_path(path)
    first = sorted(df["run_id"].unique())[0]
    run = to_run_matrix(df.filter(df["run_id"] == first))
    runtimes = run.runtimes
    if not run.present.all():
        # a worker with missing rows plays its own median run-time there
        med = np.nanmedian(np.where(run.present, runtimes, np.nan), axis=0)
        runtimes = np.where(run.present, runtimes, np.nan_to_num(med, nan=np.nanmedian(runtimes)))
    if not np.isfinite(runtimes).all():
        raise TraceError(f"{path}: replay trace has no usable run-times")
    return ReplayCluster(runtimes, run.hosts)
