"""The simulator against queueing theory, as the server sees censoring, and on a drifting cluster."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from bdsgd.stages.errors import ConfigError, TraceError
from bdsgd.stages.policies.base import Policy
from bdsgd.stages.policies.cutoff import BdsgdCutoff, StaticCutoff
from bdsgd.stages.policies.registry import make_policy
from bdsgd.stages.simulate import SimulateConfig, compare, replay, run_simulate
from bdsgd.stages.store import RunMatrix
from scipy.stats import norm


def as_run(runtimes, censored=None, present=None) -> RunMatrix:
    runtimes = np.asarray(runtimes, dtype=float)
    censored = np.zeros(runtimes.shape, bool) if censored is None else np.asarray(censored)
    present = np.ones(runtimes.shape, bool) if present is None else np.asarray(present)
    hosts = tuple(f"h{w % 2}" for w in range(runtimes.shape[1]))
    return RunMatrix("run", runtimes, censored, present, hosts)


def exponential_run(rows: int, workers: int, rate: float = 2.0, seed: int = 0) -> RunMatrix:
    return as_run(np.random.default_rng(seed).exponential(1 / rate, (rows, workers)))


def harmonic(n: int) -> float:
    return float(np.sum(1.0 / np.arange(1, n + 1)))


# -- theory (Dutta et al., i.i.d. exponential run-times with rate mu over P workers) -------------


@pytest.mark.parametrize("k", [2, 6, 8])
def test_k_sync_iteration_time_is_harmonic_difference(k):
    p, mu = 8, 2.0
    result = replay(StaticCutoff(k), exponential_run(10_000, p, mu), 0, 0.0)
    expected = (harmonic(p) - harmonic(p - k)) / mu
    assert np.mean(result.columns["iteration_s"]) == pytest.approx(expected, rel=0.03)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_k_batch_sync_applies_k_gradients_per_k_over_p_mu(k):
    p, mu = 8, 2.0
    result = replay(make_policy(f"k-batch-sync:{k}", p), exponential_run(3_000, p, mu), 0, 0.0)
    assert np.mean(result.columns["iteration_s"]) == pytest.approx(k / (p * mu), rel=0.03)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_k_async_update_time_is_kth_order_statistic_of_remaining_times(k):
    # memoryless remaining times: as K-sync, (H_P - H_{P-K}) / mu; for K = 1 that is 1 / (P mu)
    p, mu = 8, 2.0
    result = replay(make_policy(f"k-async:{k}", p), exponential_run(3_000, p, mu), 0, 0.0)
    expected = (harmonic(p) - harmonic(p - k)) / mu
    assert np.mean(result.columns["iteration_s"]) == pytest.approx(expected, rel=0.03)


def test_async_staleness_is_p_minus_one_on_average():
    p = 8
    result = replay(make_policy("async", p), exponential_run(3_000, p), 0, 0.0)
    assert np.mean(result.columns["staleness"]) == pytest.approx(p - 1, rel=0.05)
    assert result.metrics(1.0)["idle_fraction"] < 0.01


def test_overhead_is_added_per_update():
    run = exponential_run(2_000, 4)
    plain = replay(make_policy("k-async:2", 4), run, 0, 0.0)
    slow = replay(make_policy("k-async:2", 4), run, 0, 0.5)
    assert np.mean(slow.columns["iteration_s"]) > np.mean(plain.columns["iteration_s"]) + 0.3
    sync = replay(make_policy("full", 4), run, 0, 0.5)
    assert np.mean(sync.columns["iteration_s"]) == pytest.approx(
        np.mean(run.runtimes.max(axis=1)) + 0.5
    )


# -- what the policy sees -------------------------------------------------------------------


class Recorder(Policy):
    """Waits for ``c`` and remembers every observation."""

    def __init__(self, c: int) -> None:
        self.c, self.name, self.seen = c, "recorder", []

    def choose(self, live: np.ndarray) -> int:
        return self.c

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.seen.append((runtimes.copy(), censored.copy()))


def test_dropped_workers_are_seen_censored_at_the_cut():
    run = as_run([[3.0, 1.0, 2.0, 5.0]])
    policy = Recorder(2)
    result = replay(policy, run, 0, 0.0)
    runtimes, censored = policy.seen[0]
    np.testing.assert_array_equal(runtimes, [2.0, 1.0, 2.0, 2.0])
    np.testing.assert_array_equal(censored, [True, False, False, True])
    assert result.columns["iteration_s"] == [2.0] and result.columns["c"] == [2]
    assert result.metrics(1.0)["idle_fraction"] == pytest.approx(1 - 3.0 / 8.0)


def test_missing_entries_are_dead_workers():
    run = as_run([[1.0, 2.0, 9.0, 3.0]], present=[[True, True, False, True]])
    policy = Recorder(4)  # asks for more than are live: capped to 3
    result = replay(policy, run, 0, 0.0)
    assert result.columns["c"] == [3] and result.columns["workers"] == [3]
    assert result.columns["iteration_s"] == [3.0]
    runtimes, censored = policy.seen[0]
    assert censored[2] and runtimes[2] == 3.0


def test_trace_censored_entries_are_lower_bounds_and_stay_censored():
    # a train run cut workers 2 and 3 off at 2.0: waiting for 3 takes at least 2.0
    run = as_run([[1.0, 1.5, 2.0, 2.0]], censored=[[False, False, True, True]])
    policy = Recorder(3)
    result = replay(policy, run, 0, 0.0)
    assert result.columns["iteration_s"] == [2.0]
    _, censored = policy.seen[0]
    np.testing.assert_array_equal(censored, [False, False, True, True])


def test_from_frac_warms_up_on_the_head_and_simulates_the_tail():
    run = exponential_run(100, 4)
    policy = Recorder(2)
    result = replay(policy, run, 80, 0.0)
    assert len(policy.seen) == 100
    assert result.columns["iteration"] == list(range(80, 100))
    np.testing.assert_array_equal(policy.seen[0][0], run.runtimes[0])  # warm-up sees the trace


# -- a drifting, host-correlated cluster and a predictor that knows its structure -------------


@dataclass(frozen=True)
class HostRegimeCluster:
    """N workers on hosts that fall into slow spells together (a Markov chain per host), a slow
    sinusoidal drift, per-worker speeds and log-normal noise. A spell's onset is a surprise to any
    causal policy (only the oracle sees it coming), so onsets are kept rare enough (one in ~50
    iterations over the cluster) that a perfect predictive can get within 6% of the oracle."""

    workers: int = 32
    hosts: int = 4
    slow: float = 3.0
    p_slow: float = 0.005
    p_recover: float = 0.05
    sigma: float = 0.1
    drift: float = 0.3
    period: int = 300
    seed: int = 0

    def speeds(self) -> np.ndarray:
        return np.random.default_rng(self.seed).normal(0.0, 0.1, self.workers)

    def log_level(self, t: np.ndarray | int) -> np.ndarray:
        return np.log(0.05) + self.drift * np.sin(2 * np.pi * np.asarray(t) / self.period)

    def runtimes(self, rows: int) -> np.ndarray:
        rng = np.random.default_rng(self.seed + 1)
        regime, state = np.zeros((rows, self.hosts), bool), np.zeros(self.hosts, bool)
        for t in range(rows):
            u = rng.random(self.hosts)
            state = np.where(state, u >= self.p_recover, u < self.p_slow)
            regime[t] = state
        host = np.arange(self.workers) % self.hosts
        log_x = self.log_level(np.arange(rows))[:, None] + self.speeds()
        log_x = log_x + np.log(self.slow) * regime[:, host]
        return np.exp(log_x + rng.normal(0.0, self.sigma, (rows, self.workers)))


class KnownStructurePredictor:
    """A Predictor test double standing in for a perfectly fitted model: it knows the cluster's
    parameters but not the hosts' regimes, which it filters from what the server saw (exact
    run-times by their density, censored ones by their survival)."""

    def __init__(self, cluster: HostRegimeCluster, seed: int = 0) -> None:
        self.cluster, self.t = cluster, 0
        self.p_slow_host = np.zeros(cluster.hosts)
        self.host = np.arange(cluster.workers) % cluster.hosts
        self.speeds = cluster.speeds()
        self.rng = np.random.default_rng(seed)

    def _prior(self) -> np.ndarray:
        c = self.cluster
        return self.p_slow_host * (1 - c.p_recover) + (1 - self.p_slow_host) * c.p_slow

    def _mean_log(self, slow: bool) -> np.ndarray:
        c = self.cluster
        return c.log_level(self.t) + self.speeds + np.log(c.slow) * slow

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        z = {s: (np.log(runtimes) - self._mean_log(s)) / self.cluster.sigma for s in (False, True)}
        ll = {s: np.where(censored, norm.logsf(z[s]), norm.logpdf(z[s])) for s in z}
        by_host = {s: np.bincount(self.host, ll[s], self.cluster.hosts) for s in ll}
        prior = self._prior()
        log_odds = np.log(prior) - np.log1p(-prior) + by_host[True] - by_host[False]
        self.p_slow_host = 1.0 / (1.0 + np.exp(-np.clip(log_odds, -50, 50)))
        self.t += 1

    def sample(self, num_samples: int) -> torch.Tensor:
        c = self.cluster
        slow = self.rng.random((num_samples, c.hosts)) < self._prior()
        log_x = self._mean_log(False) + np.log(c.slow) * slow[:, self.host]
        noise = self.rng.normal(0.0, c.sigma, (num_samples, c.workers))
        return torch.from_numpy(np.exp(log_x + noise))


def test_bdsgd_with_a_good_predictive_beats_every_baseline():
    cluster = HostRegimeCluster()
    run = as_run(cluster.runtimes(600))
    specs = ["full", "static:31", "static:30", "static:29", "static:24", "elfving", "ecdf", "ewma"]
    metrics, _ = compare(specs, run, SimulateConfig(traces=Path("unused")))
    oracle = replay(make_policy("oracle", 32), run, 0, 0.0).metrics(1.0)["throughput"]
    bdsgd = replay(BdsgdCutoff(KnownStructurePredictor(cluster)), run, 0, 0.0)
    ratio = bdsgd.metrics(oracle)["oracle_ratio"]
    assert ratio >= 0.94
    assert all(ratio > m["oracle_ratio"] for k, m in metrics.items() if k != "ewma")
    assert ratio >= metrics["ewma"]["oracle_ratio"]


# -- the stage -------------------------------------------------------------------------------


def test_config_checks():
    with pytest.raises(ConfigError, match="either --traces DIR or --sample T --checkpoint"):
        SimulateConfig()
    with pytest.raises(ConfigError, match=r"--from-frac must be in \[0, 1\), got 1.0"):
        SimulateConfig(traces=Path("t"), from_frac=1.0)
    with pytest.raises(ConfigError, match="--sample T needs T >= 1 and --checkpoint FILE"):
        SimulateConfig(sample=10)
    with pytest.raises(ConfigError, match="--sample 1000000000 is above 1,000,000 iterations"):
        SimulateConfig(sample=10**9, checkpoint=Path("m.pt"))
    with pytest.raises(ConfigError, match="--overhead-s must be a finite number >= 0, got -1.0"):
        SimulateConfig(traces=Path("t"), overhead_s=-1.0)
    with pytest.raises(ConfigError, match="--explore"):
        SimulateConfig(traces=Path("t"), explore=1.0)


def test_explore_waits_for_everyone_in_a_fraction_of_iterations():
    run = as_run(HostRegimeCluster(workers=8, hosts=2).runtimes(400))
    plain, before = compare(["ewma", "static:4"], run, SimulateConfig(traces=Path("unused")))
    explored, after = compare(
        ["ewma", "static:4"], run, SimulateConfig(traces=Path("unused"), explore=0.25)
    )
    share = [np.mean(np.array(r[0].columns["c"]) == 8) for r in (before, after)]
    # a quarter of the iterations where ewma would have cut now wait for all 8
    assert share[1] - share[0] == pytest.approx(0.25 * (1 - share[0]), abs=0.08)
    assert explored["ewma"]["mean_c"] > plain["ewma"]["mean_c"]
    for key in ("throughput", "mean_c"):  # static policies do not explore
        assert explored["static:4"][key] == plain["static:4"][key]


def test_missing_trace_store_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError):
        run_simulate(SimulateConfig(traces=tmp_path / "nothing"))


def test_run_directory(tmp_path, monkeypatch):
    run = exponential_run(50, 6)
    monkeypatch.setattr("bdsgd.stages.simulate.load_run", lambda config: run)
    config = SimulateConfig(
        traces=tmp_path / "t", out=tmp_path / "out", policies=("full", "ewma", "async")
    )
    summary = run_simulate(config)
    assert summary["workers"] == 6 and summary["iterations"] == 50
    assert set(summary["policies"]) == {"full", "ewma", "async"}
    assert summary["best"] == "ewma" and summary["best_async"] == "async"
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written["kind"] == "simulate" and written["traces"] == str(tmp_path / "t")
    table = pq.read_table(tmp_path / "out" / "iterations.parquet").to_pydict()
    assert set(table["policy"]) == {"full", "ewma", "async"}
    ewma_q50 = [q for p, q in zip(table["policy"], table["pred_q50"], strict=True) if p == "ewma"]
    assert all(q is not None for q in ewma_q50[1:])


class OnlineRecorder(Recorder):
    """Chooses ``c``, then at each arrival revises to ``revised``; records the revise calls."""

    online = True

    def __init__(self, c: int, revised: int) -> None:
        super().__init__(c)
        self.revised = revised
        self.calls: list[tuple[float, np.ndarray]] = []

    def revise(self, now_s, runtimes, arrived) -> int:
        self.calls.append((now_s, arrived.copy()))
        return self.revised


@pytest.mark.parametrize(
    ("c", "revised", "ends", "asked"), [(3, 1, 1, 1), (2, 3, 3, 2), (1, 3, 1, 0)]
)
def test_an_online_policy_ends_the_iteration_at_its_revised_c(c, revised, ends, asked):
    """A revision moves the c that stands; the arrival of the standing c ends the iteration
    unasked (in training the rank that takes that ticket cuts): c = 1 cannot be raised at the
    first arrival, c = 2 raised to 3 at the first ends at the third."""
    run = as_run(np.array([[4.0, 1.0, 3.0, 2.0]]))
    policy = OnlineRecorder(c, revised)
    result = replay(policy, run, 0, 0.0)
    assert result.columns["c"] == [ends]
    assert result.columns["iteration_s"] == [float(ends)]  # the ending arrival's run-time
    # asked at each arrival before the one that ended it, with exactly the workers in so far,
    # and in between at ticks (0.05 s after an arrival, doubling) with the same workers in
    arrivals = [call for i, call in enumerate(policy.calls)
                if i == 0 or call[1].sum() != policy.calls[i - 1][1].sum()]  # fmt: skip
    assert [now for now, _ in arrivals] == [1.0, 2.0, 3.0][:asked]
    assert [a.sum() for _, a in arrivals] == list(range(1, asked + 1))
    ticks = [now for now, a in policy.calls if a.sum() == 1]
    assert ticks == pytest.approx([1.0, 1.05, 1.1, 1.2, 1.4, 1.8][: len(ticks)])
    assert bool(ticks) == (asked > 0)
    runtimes, censored = policy.seen[0]
    assert censored.sum() == 4 - ends and np.all(runtimes[censored] == float(ends))


@pytest.mark.parametrize("terminal", [True, False])
def test_long_work_shows_progress_on_a_terminal_alone(monkeypatch, capsys, terminal):
    """A replay through every policy, or a large --sample, shows a bar on a terminal; in a log
    or a pipe stderr stays as it was (simulate's output there is its table)."""
    from bdsgd.stages import simulate as S

    monkeypatch.setattr(type(S.console), "is_terminal", property(lambda self: terminal))
    with S.shown("replaying", 3) as step:
        step(0, "oracle")
        step(2, "full")
        step(1, "")
    err = capsys.readouterr().err
    assert ("replaying" in err and "3/3" in err) is terminal
    assert (err == "") is not terminal


def test_salvage_counts_the_finished_micro_batches_of_cut_workers():
    from bdsgd.stages.simulate import salvaged

    runtimes = np.array([0.1, 0.2, 0.4, np.inf])
    live = np.array([True, True, True, True])
    # cut at 0.2 after workers 0 and 1: worker 2 finished 2 of 4, worker 3 (unknown) none
    assert salvaged(runtimes, live, (0, 1), 0.2, 4) == pytest.approx((0.5, 0.2))
    assert salvaged(runtimes, live, (0,), 0.1, 4) == pytest.approx((0.5 + 0.25, 0.1))
    # cut at 0.25: worker 2 is in its third part, finishes it at 0.3 and counts it
    assert salvaged(runtimes, live, (0, 1), 0.25, 4) == pytest.approx((0.75, 0.3))
    dead = np.array([True, True, False, True])
    assert salvaged(runtimes, dead, (0, 1), 0.2, 4) == (0.0, 0.2)
    assert salvaged(runtimes, live, (0, 1), 0.25, 1) == (0.0, 0.25)


def test_sample_throughput_is_reported_with_micro_batches():
    runtimes = np.array([[0.1, 0.1, 0.1, 0.4]] * 20)
    mask = np.ones_like(runtimes, dtype=bool)
    run = RunMatrix("r", runtimes, ~mask, mask, ("h",) * 4)
    metrics, _ = compare(["static:3"], run, SimulateConfig(traces=Path("r"), micro_batches=4))
    m = metrics["static:3"]
    assert m["throughput"] == pytest.approx(30.0)  # 3 gradients per 0.1 s
    assert m["sample_throughput"] == pytest.approx(32.5)  # + a quarter of the slow one's
    plain, _ = compare(["static:3"], run, SimulateConfig(traces=Path("r")))
    assert "sample_throughput" not in plain["static:3"]


def test_a_worker_cut_in_its_last_micro_batch_finishes_it_and_is_not_censored():
    from bdsgd.stages.policies.cutoff import StaticCutoff
    from bdsgd.stages.policies.driver import IterationDriver
    from bdsgd.stages.simulate import drive

    runtimes = np.array([0.1, 0.105, 0.4])
    live = np.ones(3, dtype=bool)
    out = drive(IterationDriver(StaticCutoff(1), 3), live, runtimes, micro_batches=4)
    assert out.c == 1 and out.censored.tolist() == [False, False, True]
    assert out.runtimes.tolist() == pytest.approx([0.1, 0.105, 0.1])
    plain = drive(IterationDriver(StaticCutoff(1), 3), live, runtimes)
    assert plain.censored.tolist() == [False, True, True]
