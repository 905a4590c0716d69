"""Injected stragglers: per-(iteration, worker) delays added on top of real computation.

Specs (``--stragglers``):

- ``none``: real contention only.
- ``synthetic[:key=value,...]``: a synthetic cluster (:class:`SyntheticCluster`): workers spread
  over emulated hosts; each host switches between a normal and a slow regime (a Markov chain, so
  slowdowns come and go and hit every worker of the host together); the whole cluster drifts
  slowly; every delay has log-normal noise and rare heavy-tailed (Pareto) spikes.
- ``replay:PATH``: the run-times of a schema-v1 trace store or Parquet file. Worker w plays trace
  worker ``w mod N'`` and iteration t plays ``t mod T'`` of the trace's first run.

``--time-scale`` multiplies every delay (e.g. 0.01 turns a 1 s cluster into 10 ms).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from stages.errors import ConfigError, TraceError


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
    seed: int = 0

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.hosts < 1 or self.slow_factor < 1:
            raise ConfigError("synthetic stragglers need base_s > 0, hosts >= 1, slow_factor >= 1")
        for name in ("p_slow", "p_recover", "spike_p"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"synthetic stragglers: {name} must be in [0, 1]")
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
        """(T, N) delays in seconds; the same for the same seed, whatever process asks."""
        return np.exp(self.log_delays(iterations, workers).sum(axis=0))

    def log_delays(self, iterations: int, workers: int) -> np.ndarray:
        """The (5, T, N) terms whose sum is the log delay: base and worker speed, drift, the host
        regime, noise, spikes. Kept apart so a benchmark can build the true predictive."""
        rng = np.random.default_rng(self.seed)
        host = np.arange(workers) % self.hosts
        terms = np.zeros((5, iterations, workers))
        terms[0] = np.log(self.base_s) + rng.normal(0, self.worker_spread, workers)[None, :]
        t = np.arange(iterations)[:, None]
        terms[1] = self.drift * np.sin(2 * np.pi * t / self.drift_period + rng.uniform(0, 6.3))
        terms[2] = np.log(self.slow_factor) * self.host_regimes(iterations, rng)[:, host]
        terms[3] = rng.normal(0, self.sigma, (iterations, workers))
        spikes = rng.random((iterations, workers)) < self.spike_p
        terms[4] = spikes * np.log(rng.pareto(self.spike_alpha, (iterations, workers)) + 1.0)
        return terms


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


@dataclass(frozen=True)
class NoStragglers:
    def host_of(self, workers: int) -> list[str] | None:
        return None

    def delays(self, iterations: int, workers: int) -> np.ndarray:
        return np.zeros((iterations, workers))


@dataclass(frozen=True)
class Scaled:
    """Any straggler model with its delays multiplied by ``scale``."""

    inner: SyntheticCluster | ReplayCluster | NoStragglers
    scale: float

    def host_of(self, workers: int) -> list[str] | None:
        return self.inner.host_of(workers)

    def delays(self, iterations: int, workers: int) -> np.ndarray:
        return self.inner.delays(iterations, workers) * self.scale


def parse_stragglers(spec: str, seed: int = 0, time_scale: float = 1.0) -> Scaled:
    """Turn a ``--stragglers`` spec into a model. Raises ConfigError/TraceError on bad specs."""
    if time_scale <= 0:
        raise ConfigError("--time-scale must be > 0")
    kind, _, arg = spec.partition(":")
    if kind == "none" and not arg:
        return Scaled(NoStragglers(), time_scale)
    if kind == "synthetic":
        return Scaled(SyntheticCluster(seed=seed, **_parse_params(arg)), time_scale)
    if kind == "replay":
        if not arg:
            raise ConfigError("--stragglers replay:PATH needs a path")
        return Scaled(load_replay(arg), time_scale)
    raise ConfigError(
        f"unknown --stragglers spec {spec!r} (none, synthetic[:k=v,...], replay:PATH)"
    )


def _parse_params(arg: str) -> dict:
    fields = {f.name: f.type for f in dataclasses.fields(SyntheticCluster)}
    params: dict = {}
    for item in filter(None, arg.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in fields or key == "seed":
            known = ", ".join(k for k in fields if k != "seed")
            raise ConfigError(f"bad synthetic straggler parameter {item!r} (known: {known})")
        try:
            params[key] = int(value) if fields[key] in ("int", int) else float(value)
        except ValueError:
            raise ConfigError(
                f"synthetic straggler parameter {key} needs a number, got {value!r}"
            ) from None
    return params


def load_replay(path: str) -> ReplayCluster:
    """Read the first run of a schema-v1 trace (store directory or file) for replay."""
    from stages.store import read_trace_path, to_run_matrix

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
