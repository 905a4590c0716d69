"""Exploration: the wrapper overrides the cutoff in a fraction of iterations, nothing else."""

from __future__ import annotations

import numpy as np
import pytest
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.policies.asynchronous import KAsync
from bdsgd.stages.policies.cutoff import StaticCutoff
from bdsgd.stages.policies.explore import Exploring
from bdsgd.stages.policies.registry import make_policy

LIVE = np.array([True, True, False, True])


class Counting(StaticCutoff):
    """static:1 that counts what it was asked and told."""

    def __init__(self) -> None:
        super().__init__(1)
        self.chosen = self.observed = 0

    def choose(self, live: np.ndarray) -> int:
        self.chosen += 1
        return super().choose(live)

    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        self.observed += 1


def test_explores_the_given_fraction_and_waits_for_every_live_worker():
    inner = Counting()
    policy = Exploring(inner, 0.2, seed=3)
    choices = [policy.choose(LIVE) for _ in range(2000)]
    assert set(choices) == {1, 3}  # 3: every live worker, not the 4 configured
    assert choices.count(3) == policy.explored
    assert 0.17 < policy.explored / 2000 < 0.23
    assert inner.chosen == 2000  # the inner policy still decides every iteration
    policy.observe(np.ones(4), np.zeros(4, dtype=bool))
    assert inner.observed == 1


def test_forwards_name_and_overhead():
    inner = Counting()
    policy = Exploring(inner, 0.1)
    policy.overhead_s = 0.25
    assert inner.overhead_s == 0.25 and policy.overhead_s == 0.25
    assert policy.name == "static:1" and policy.mode == "sync"


@pytest.mark.parametrize("fraction", [-0.1, 1.0])
def test_bad_fraction_is_a_config_error(fraction):
    with pytest.raises(ConfigError, match="--explore"):
        Exploring(Counting(), fraction)
    with pytest.raises(ConfigError, match="--explore"):
        make_policy("ewma", 4, explore=fraction)


def test_only_cutoff_policies_explore():
    with pytest.raises(ConfigError, match="cutoff policies"):
        Exploring(KAsync(2), 0.1)
    assert isinstance(make_policy("ewma", 4, explore=0.1), Exploring)
    assert isinstance(make_policy("elfving", 4, explore=0.1), Exploring)
    for spec in ("full", "static:2", "k-async:2", "oracle"):
        assert not isinstance(make_policy(spec, 4, explore=0.1), Exploring)
    assert not isinstance(make_policy("ewma", 4), Exploring)
