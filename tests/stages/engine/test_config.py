"""Config defaults live in one place: the stage dataclasses. The engine's config and the CLI
options agree with them field by field."""

from __future__ import annotations

import dataclasses

import click
import pytest
from bdsgd.stages.engine.config import EngineConfig, engine_config
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.profile import ProfileConfig
from bdsgd.stages.train import TrainConfig

from bdsgd_cli.profile import profile
from bdsgd_cli.train import train


def defaults(cls) -> dict:
    return {
        f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
    }


@pytest.mark.parametrize("stage", [TrainConfig, ProfileConfig])
def test_the_engine_config_defaults_equal_the_stage_defaults(stage):
    engine, ours = defaults(EngineConfig), defaults(stage)
    shared = engine.keys() & ours.keys()
    assert {"device", "batch_size", "micro_batches", "timeout_s", "host"} <= shared
    assert {k: engine[k] for k in shared} == {k: ours[k] for k in shared}


@pytest.mark.parametrize(("command", "stage"), [(train, TrainConfig), (profile, ProfileConfig)])
def test_the_cli_defaults_equal_the_stage_defaults(command: click.Command, stage):
    ours = defaults(stage)
    options = {p.name: flag_or_default(p) for p in command.params if isinstance(p, click.Option)}
    shared = options.keys() & ours.keys()
    assert {"device", "batch_size", "micro_batches", "seed"} <= shared
    assert {k: options[k] for k in shared} == {k: ours[k] for k in shared}


def flag_or_default(option: click.Option):
    """An option's default as the stage sees it: a flag without one is off, any other option
    without one is None (click marks both unset), ``--overhead-s auto`` is None (measured)."""
    if option.name == "overhead_s" and option.default == "auto":
        return None
    if not isinstance(option.default, (bool, int, float, str, type(None))):
        return False if option.is_flag else None
    return option.default


def test_engine_config_copies_every_field_of_the_same_name(tmp_path):
    stage = TrainConfig(workers=3, iterations=5, policy="async", traces=tmp_path, out=tmp_path,
                        batch_size=12, micro_batches=3, lr=0.2)  # fmt: skip
    cfg = engine_config(stage, run_id="r", source="train", hosts=("h",) * 3)
    assert (cfg.batch_size, cfg.micro_batches, cfg.lr) == (12, 3, 0.2)


def test_an_unknown_device_is_refused():
    with pytest.raises(ConfigError, match="--device must be one of"):
        EngineConfig(workers=1, iterations=1, run_id="r", source="train", device="tpu")
