"""One policy driver for the simulator and the training loop: the same arrivals give the same c and the
same censoring, whichever drives them."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from bdsgd.stages.fit import FitConfig, run_fit
from bdsgd.stages.policies.driver import IterationDriver
from bdsgd.stages.policies.registry import make_policy
from bdsgd.stages.simulate import drive
from bdsgd.stages.store import TraceStore
from bdsgd.stages.stragglers import SyntheticCluster

from tests.cli.test_profile_cli import bdsgd
from tests.stages.engine import write_replay_trace


class Fixed:
    """A minimal fixed-c policy (the driver's contract only)."""

    online = False
    overhead_s = 0.0

    def __init__(self, c):
        self.c, self.seen = c, []

    def choose(self, live):
        return self.c

    def observe(self, runtimes, censored):
        self.seen.append((runtimes.copy(), censored.copy()))


def test_the_driver_ends_at_c_and_censors_the_rest_at_the_cut():
    policy = Fixed(2)
    driver = IterationDriver(policy, 4)
    out = drive(driver, np.ones(4, dtype=bool), np.array([0.3, 0.1, 0.4, 0.2]))
    assert out.order == (1, 3) and out.c == 2 and out.cut_s == 0.2
    assert out.censored.tolist() == [True, False, True, False]
    assert out.runtimes.tolist() == [0.2, 0.1, 0.2, 0.2]
    assert np.array_equal(policy.seen[0][1], out.censored)


class Patient(Fixed):
    """Online: at each arrival waits for every worker; asked again while nothing arrives, stops
    once ``give_up_s`` has passed. Records the presents it was asked at."""

    online = True

    def __init__(self, give_up_s):
        super().__init__(4)
        self.give_up_s, self.asked = give_up_s, []

    def revise(self, now_s, runtimes, arrived):
        self.asked.append(round(now_s, 6))
        return int(arrived.sum()) if now_s >= self.give_up_s else 4


def test_a_waiting_online_policy_is_asked_again_and_cuts_between_arrivals():
    """Arrivals at 0.1, 0.12 and 5.0 s: asked at each arrival, then at ticks 0.05 s after the
    last one and doubling (0.17, 0.22, 0.32): it stops at 0.32, and the iteration is cut there,
    the two workers still out censored at 0.32."""
    policy = Patient(give_up_s=0.3)
    out = drive(IterationDriver(policy, 4), np.ones(4, dtype=bool),
                np.array([0.1, 0.12, 5.0, 9.0]))  # fmt: skip
    assert policy.asked == [0.1, 0.12, 0.17, 0.22, 0.32]
    assert out.order == (0, 1) and out.cut_s == pytest.approx(0.32)
    assert out.censored.tolist() == [False, False, True, True]
    assert out.runtimes[2:].tolist() == pytest.approx([0.32, 0.32])


def test_a_policy_that_waits_is_not_asked_again_once_the_last_worker_arrives():
    policy = Patient(give_up_s=10.0)
    out = drive(IterationDriver(policy, 2), np.ones(2, dtype=bool), np.array([0.1, 0.5]))
    assert out.c == 2 and out.cut_s == 0.5
    assert policy.asked == [0.1, 0.15, 0.2, 0.3]  # ticks before 0.5; the last arrival ends it


def test_arrivals_read_together_are_admitted_and_revised_once_at_the_last():
    """A batch of three: all admitted, the policy asked once (at the latest run-time in); an
    arrival after the cut is admitted without asking it."""
    policy = Patient(give_up_s=0.0)  # cuts at whatever has arrived when asked
    driver = IterationDriver(policy, 5)
    driver.begin(np.ones(5, dtype=bool))
    assert driver.arrive_all([(3, 0.1), (0, 0.3), (4, 0.2)])
    assert policy.asked == [0.3] and driver.order == [3, 0, 4] and driver.target == 3
    driver.arrive(1, 0.4, revise=False)  # its ticket raced the close
    out = driver.end()
    assert policy.asked == [0.3] and out.order == (3, 0, 4, 1)
    assert out.censored.tolist() == [False, False, True, False, False]


def test_a_batch_that_the_revision_waits_past_does_not_end_the_iteration():
    policy = Patient(give_up_s=1.0)  # waits for every worker until 1 s
    driver = IterationDriver(policy, 4)
    driver.begin(np.ones(4, dtype=bool))
    assert not driver.arrive_all([(0, 0.1), (1, 0.2)])
    assert policy.asked == [0.2] and driver.next_tick == pytest.approx(0.25)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_simulator_and_the_training_loop_agree_on_recorded_arrivals_with_online_bdsgd(tmp_path):
    """Fit a tiny model, train 4 real ranks (``bdsgd train``: the library's loop) with online
    bdsgd on a replayed cluster whose ranks finish at least 90 ms apart, then feed the
    arrivals the run recorded (in run-time order) through the simulator's driver with the same
    policy: same c and same censoring every iteration, up to the first one where a rank's
    ticket raced the close and was admitted past the policy's c, which no replay can
    reproduce (the policies' states part there)."""
    cluster = SyntheticCluster(base_s=0.05, hosts=2, p_slow=0.05, seed=3)
    profile = write_replay_trace(tmp_path / "profile", cluster.delays(120, 4).tolist())
    ckpt = tmp_path / "m.pt"
    run_fit(FitConfig(traces=profile, checkpoint=ckpt, steps=10, window=16, batch=4,
                      eval_samples=16, progress=False))  # fmt: skip
    gaps = [[0.01, 0.12, 0.3, 0.6], [0.3, 0.01, 0.6, 0.12], [0.12, 0.6, 0.01, 0.3]] * 4
    replay = write_replay_trace(tmp_path / "replay", gaps)
    iterations = len(gaps)
    done = bdsgd("train", "--workers", "4", "--iterations", str(iterations), "--policy", "bdsgd",
                 "--checkpoint", str(ckpt), "--stragglers", f"replay:{replay}", "--seed", "5",
                 "--overhead-s", "0", "--batch-size", "8", "--micro-batches", "2",
                 "--traces", str(tmp_path / "traces"), "--out", str(tmp_path / "run"),
                 timeout=540)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = TraceStore(tmp_path / "traces").read().sort("iteration", "worker")
    hosts = rows.filter(pl.col("iteration") == 0)["host"].to_list()
    replayed = make_policy("bdsgd", 4, ckpt, hosts, seed=5, overhead_s=0.0)
    replayed.salvage_parts = 2  # (the loop salvages its 2 micro-batches, by default)
    driver = IterationDriver(replayed, 4)
    cs = []
    for t in range(iterations):
        it = rows.filter(pl.col("iteration") == t)
        censored = it["censored"].to_numpy()
        recorded = it["runtime_s"].to_numpy()
        runtimes = np.where(censored, np.inf, recorded)
        out = drive(driver, np.ones(4, dtype=bool), runtimes)
        if out.c < int((~censored).sum()):
            break  # a ticket raced the close: admitted past the policy's c
        assert out.c == int((~censored).sum()), t
        assert out.censored.tolist() == censored.tolist(), t
        assert np.array_equal(out.runtimes[~censored], recorded[~censored]), t
        assert np.all(recorded[censored] > 0), t  # (a cut at the coordinator's clock)
        cs.append(out.c)
    assert cs, "no iteration could be compared"
    assert len(cs) < iterations or len(set(cs)) > 1 or cs[0] < 4  # bdsgd did cut: not all-full
