"""One asynchronous driver for the simulator and the asynchronous server: the same arrivals give
the same K, the same senders, the same staleness and the same censoring, whichever drives them."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from bdsgd.stages.engine.config import EngineConfig
from bdsgd.stages.engine.launch import run_engine
from bdsgd.stages.policies.async_driver import AsyncDriver
from bdsgd.stages.policies.asynchronous import AdaSync
from bdsgd.stages.simulate import async_update
from bdsgd.stages.store import TraceStore

from tests.stages.engine import write_replay_trace


class Recorded(AdaSync):
    """``adasync`` that keeps every observation (K varies: 1, then 2, then capped at 3)."""

    def __init__(self) -> None:
        super().__init__(period=4)
        self.seen: list[tuple[np.ndarray, np.ndarray]] = []

    def observe(self, runtimes, censored):
        self.seen.append((runtimes.copy(), censored.copy()))


def test_the_driver_takes_k_gradients_and_censors_the_rest_at_their_time_so_far():
    policy = Recorded()
    driver = AsyncDriver(policy, 3)
    driver.restart([0, 1, 2], 0.0)
    first = async_update(driver, np.ones(3, dtype=bool), [(1, 0.2, 0.2), (0, 0.3, 0.3)])
    assert first.chosen_k == 1 and first.order == (1,) and first.at == 0.2
    assert first.censored.tolist() == [True, False, True]
    assert first.runtimes.tolist() == pytest.approx([0.2, 0.2, 0.2])  # 0.2 s run so far
    assert first.staleness.tolist() == [0]
    # worker 1 restarted at 0.2 on version 1; worker 0 still computes on version 0
    second = async_update(driver, np.ones(3, dtype=bool), [(0, 0.3, 0.3)], overhead_s=0.01)
    assert second.order == (0,) and second.staleness.tolist() == [1]
    assert second.runtimes.tolist() == pytest.approx([0.3, 0.11, 0.31])
    assert driver.version == 2 and driver.read.tolist() == [2, 1, 0]


def test_a_dead_worker_is_observed_at_the_longest_run_time_applied():
    driver = AsyncDriver(Recorded(), 3)
    driver.restart([0, 1, 2], 0.0)
    driver.begin(np.array([True, True, False]))
    driver.arrive(0, 0.4)
    update = driver.end(1.0, live=np.array([True, True, False]))
    assert update.runtimes.tolist() == pytest.approx([0.4, 1.0, 0.4])
    assert update.censored.tolist() == [False, True, True]


def test_a_slot_that_delivers_nothing_keeps_the_parameters_it_read():
    driver = AsyncDriver(Recorded(), 2)
    driver.restart([0, 1], 0.0)
    async_update(driver, np.ones(2, dtype=bool), [(0, 0.1, 0.1)])
    driver.restart(1, 0.15, fresh=False)
    assert driver.read.tolist() == [1, 0] and driver.began.tolist() == [0.1, 0.15]


@pytest.mark.timeout(300)
def test_simulator_and_server_agree_on_recorded_arrivals_with_adasync(tmp_path):
    """Train 3 real workers with adasync (K 1, then 2, then 3) on a replayed cluster, then feed
    the gradients the server applied (in its arrival order, with the run-times its trace rows
    hold) through the simulator's update with a fresh policy: the same K, senders, staleness and
    censoring every update. Arrival order is whatever the machine made it; the replay takes it
    as recorded, so the comparison holds however loaded the machine is."""
    delays = [[0.01, 0.04, 0.15], [0.03, 0.01, 0.09], [0.02, 0.06, 0.01]] * 4
    replay = write_replay_trace(tmp_path / "replay", delays)
    cfg = EngineConfig(workers=3, iterations=20, run_id="agree-async", source="train",
                       stragglers=f"replay:{replay}", batch_size=8, micro_batches=2,
                       hosts=("h0", "h1", "h2"), timeout_s=60.0)  # fmt: skip
    policy = Recorded()
    result = run_engine(cfg, policy, tmp_path / "traces", lambda t, r: None)
    assert not result.dead_workers and not result.interrupted
    rows = TraceStore(tmp_path / "traces").read()
    runtime_of = {(w, j): rt for w, j, rt in rows.select("worker", "iteration", "runtime_s").rows()}
    assert rows.filter(pl.col("censored")).height <= cfg.workers  # only the end cuts any short

    replayed = Recorded()
    driver = AsyncDriver(replayed, 3)
    driver.restart([0, 1, 2], 0.0)
    computation = [0, 0, 0]  # each worker's computation under way (its trace rows' iteration)
    for u, senders in enumerate(result.log["order"]):
        arrivals = [(w, runtime_of[(w, computation[w])], 0.0) for w in senders]
        update = async_update(driver, np.ones(3, dtype=bool), arrivals)
        assert update is not None and update.order == tuple(senders), u
        assert update.chosen_k == result.log["chosen_c"][u] == len(senders), u
        assert update.staleness.mean() == result.log["staleness"][u], u
        runtimes, censored = policy.seen[u]
        assert update.censored.tolist() == censored.tolist(), u
        assert np.array_equal(update.runtimes[~censored], runtimes[~censored]), u
        for w in senders:
            computation[w] += 1
    ks = result.log["chosen_c"]
    assert ks[:4] == [1, 1, 1, 1] and 2 in ks and ks[-1] == 3  # the schedule did change K
    assert max(result.log["staleness"]) > 0  # some gradient was applied late
