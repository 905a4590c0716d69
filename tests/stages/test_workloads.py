"""stages/workloads.py: the built-in workloads and a user's ``module:function``, whose every
failure is one line naming the workload."""

from __future__ import annotations

import pytest
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.workloads import Workload, load_workload


def raising(seed: int = 0) -> Workload:
    """A user's factory that fails: only the first line of its message is reported."""
    raise ValueError(f"no data for seed {seed}\nsecond line")


def test_builtin_workload_builds():
    workload = load_workload("mlp", seed=1)
    assert isinstance(workload, Workload) and workload.name == "mlp"


@pytest.mark.parametrize("spec", ["nosuch_module_xyz:make", "math:nosuch", "mlp2", "math:"])
def test_unknown_module_attribute_or_name_is_one_line(spec):
    with pytest.raises(ConfigError, match=f"workload '{spec}'") as info:
        load_workload(spec)
    assert "\n" not in str(info.value)


def test_non_callable_attribute_is_refused():
    with pytest.raises(ConfigError, match="'math:pi': math.pi is a float, not a function"):
        load_workload("math:pi")


def test_a_raising_factory_is_one_line_naming_the_workload():
    spec = f"{__name__}:raising"
    with pytest.raises(ConfigError) as info:
        load_workload(spec, seed=3)
    assert str(info.value) == f"workload '{spec}' failed: ValueError: no data for seed 3"
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_module_failing_on_import_is_one_line(tmp_path, monkeypatch):
    """Its error is the user's code's (not a missing module): one line naming the workload."""
    (tmp_path / "bdsgd_test_badmod.py").write_text("x = 1\nraise ValueError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        load_workload("bdsgd_test_badmod:make")
    assert str(info.value) == (
        "workload 'bdsgd_test_badmod:make' failed on import: ValueError: no GPU here"
    )
    with pytest.raises(ConfigError, match="cannot load workload 'json:nothing': json has no "):
        load_workload("json:nothing")
    with pytest.raises(ConfigError, match="cannot load workload 'bdsgd_no_such_module:f'"):
        load_workload("bdsgd_no_such_module:f")


def test_a_factory_not_taking_seed_is_one_line():
    with pytest.raises(ConfigError, match=r"workload 'os:getcwd' failed: TypeError: ") as info:
        load_workload("os:getcwd")
    assert "\n" not in str(info.value)


def test_a_factory_returning_something_else_is_refused():
    with pytest.raises(ConfigError, match="'builtins:dict' returned dict, not a Workload"):
        load_workload("builtins:dict")
