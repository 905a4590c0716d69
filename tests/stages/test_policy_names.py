"""The torch-free spec grammar refuses exactly what the registry refuses, with its message."""

from __future__ import annotations

import pytest
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.policies.registry import make_policy
from bdsgd.stages.policy_names import NEEDS_MODEL, check_spec, kind_of

SPECS = [
    "full", "oracle", "async", "static:3", "static:4", "static:0", "static:5", "static",
    "static:x", "k-async:2", "k-batch-sync:9", "adasync", "adasync:", "adasync:50", "adasync:0",
    "elfving", "elfving:goodput", "elfving:iteration", "ecdf", "ecdf:iteration:online",
    "ewma:goodput:fixed", "ewma:fixed:fixed", "ecdf:unchecked", "bdsgd:unchecked:goodput",
    "ecfd", "full:1", "async:goodput", "static:goodput", " ewma ", "",
]  # fmt: skip


def outcome(fn) -> str | None:
    try:
        fn()
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("spec", SPECS)
def test_check_spec_matches_the_registry(spec: str) -> None:
    built = outcome(lambda: make_policy(spec, 4))
    checked = outcome(lambda: check_spec(spec, 4))
    if kind_of(spec) == "bdsgd":  # the registry builds nothing without a model
        assert built == NEEDS_MODEL or built == checked
    else:
        assert checked == built


def test_bdsgd_without_a_model_names_both_callers() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint=\.\.\. in the library, --checkpoint on"):
        check_spec("bdsgd", 4, has_model=False)
    check_spec("bdsgd", 4, has_model=True)


def test_any_cluster_size_when_unknown() -> None:
    check_spec("static:1000")
    with pytest.raises(ConfigError, match="need at least one worker"):
        check_spec("full", 0)
