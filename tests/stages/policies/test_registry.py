"""Policy specs to policies."""

from __future__ import annotations

import pytest
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.policies.asynchronous import AdaSync, KAsync, KBatchSync
from bdsgd.stages.policies.cutoff import EwmaCutoff, StaticCutoff
from bdsgd.stages.policies.registry import decision_samples, default_policy_specs, make_policy


def test_specs_build_named_policies():
    assert make_policy("static:6", 8).name == "static:6"
    assert isinstance(make_policy("static:6", 8), StaticCutoff)
    assert isinstance(make_policy("ewma", 8), EwmaCutoff)
    assert isinstance(make_policy("k-batch-sync:4", 8), KBatchSync)
    async_ = make_policy("async", 8)
    assert isinstance(async_, KAsync) and async_.k == 1 and async_.name == "async"
    assert make_policy("full", 8, overhead_s=0.25).overhead_s == 0.25


def test_adasync_period_spans_the_run():
    assert make_policy("adasync:50", 8).period == 50
    policy = make_policy("adasync", 8, iterations=400)
    assert isinstance(policy, AdaSync) and policy.period == 400 * 8 // 4  # K = 1, 2, 4, 8


@pytest.mark.parametrize(
    "spec", ["nope", "static", "static:x", "static:0", "static:9", "full:3", "k-async:"]
)
def test_bad_specs_are_one_line_config_errors(spec):
    with pytest.raises(ConfigError, match=f"policy '{spec}'") as err:
        make_policy(spec, 8)
    assert "\n" not in str(err.value)


def test_bdsgd_without_checkpoint_says_what_to_pass():
    with pytest.raises(ConfigError, match="--checkpoint"):
        make_policy("bdsgd", 8)


def test_default_specs():
    specs = default_policy_specs(20, with_checkpoint=False)
    assert specs[0] == "full" and specs[-1] == "oracle"
    assert {"static:19", "static:18", "static:15", "elfving", "ecdf", "ewma", "async"} <= set(specs)
    assert "bdsgd" not in specs
    assert "bdsgd" in default_policy_specs(20, with_checkpoint=True)
    assert default_policy_specs(1, with_checkpoint=False)[0] == "full"


def test_monte_carlo_policies_take_an_objective():
    assert make_policy("ewma", 4).objective == "long-run"
    policy = make_policy("ecdf:iteration", 4)
    assert (policy.name, policy.objective) == ("ecdf:iteration", "iteration")
    assert make_policy("ewma:long-run", 4).name == "ewma"
    with pytest.raises(ConfigError, match="objective"):
        make_policy("ewma:fastest", 4)


def test_monte_carlo_policies_take_a_stopping_rule_in_either_order():
    assert not make_policy("ewma", 4).online
    policy = make_policy("ewma:online:iteration", 4)
    assert policy.online and policy.objective == "iteration"
    assert policy.name == make_policy("ewma:iteration:online", 4).name == "ewma:iteration:online"
    with pytest.raises(ConfigError, match="at most one of each"):
        make_policy("ecdf:online:fixed", 4)
    with pytest.raises(ConfigError, match="unknown policy"):
        make_policy("elfving:iteration", 4)


def test_a_decision_draws_fewer_samples_the_more_workers_each_orders():
    requested = 256
    sizes = {n: decision_samples(requested, n) for n in (8, 64, 128, 255, 256, 1024, 4096)}
    assert sizes == {8: 256, 64: 256, 128: 128, 255: 64, 256: 32, 1024: 32, 4096: 32}
    assert decision_samples(16, 1024) == 16  # never more than asked for
