"""The train stage's pure parts: time_to_loss, config checks, policies it refuses."""

from __future__ import annotations

import pytest

from stages.errors import CheckpointError, ConfigError
from stages.train import TrainConfig, build_policy, load_state, resume_config, time_to_loss


def test_time_to_loss_smooths_before_comparing():
    log = {"loss": [2.0, 0.0, 0.0, 0.0], "wall_s": [1.0, 2.0, 3.0, 4.0]}
    # EWMA with alpha 0.5: 2.0, 1.0, 0.5, 0.25 -- a single low loss is not enough
    assert time_to_loss(log, 0.6, alpha=0.5) == 3.0
    assert time_to_loss(log, 2.0, alpha=0.5) == 1.0


def test_time_to_loss_skips_missing_losses_and_is_none_when_never_reached():
    log = {"loss": [None, 3.0, 2.5], "wall_s": [1.0, 2.0, 3.0]}
    assert time_to_loss(log, 1.0) is None
    assert time_to_loss(log, 3.0) == 2.0
    assert time_to_loss(log, None) is None
    assert time_to_loss({}, 1.0) is None


def config(tmp_path, **overrides) -> TrainConfig:
    values = dict(
        workers=4, iterations=10, policy="static:3", traces=tmp_path / "t", out=tmp_path / "o"
    )
    return TrainConfig(**{**values, **overrides})


@pytest.mark.parametrize(
    "bad",
    [
        dict(workers=0),
        dict(lr_scaling="cubic"),
        dict(min_workers=5),
        dict(batch_size=2, micro_batches=4),
        dict(lr=0.0),
    ],
)
def test_train_config_rejects_bad_values(tmp_path, bad):
    with pytest.raises(ConfigError):
        config(tmp_path, **bad)


@pytest.mark.parametrize("policy", ["async", "k-async:2", "oracle"])
def test_train_refuses_policies_it_cannot_run(tmp_path, policy):
    cfg = config(tmp_path, policy=policy)
    with pytest.raises(ConfigError):
        build_policy(cfg, ("h",) * 4)


def test_config_round_trips_through_the_run_dir(tmp_path):
    cfg = config(tmp_path, target_loss=0.5)
    cfg.out.mkdir()
    (cfg.out / "config.json").write_text(__import__("json").dumps(cfg.to_json()))
    assert resume_config(cfg.out) == cfg
    assert resume_config(cfg.out, iterations=20).iterations == 20


def test_resume_without_state_is_refused(tmp_path):
    with pytest.raises(CheckpointError):
        load_state(tmp_path)
    with pytest.raises(ConfigError):
        resume_config(tmp_path)
