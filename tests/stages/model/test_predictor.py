"""The per-iteration predictor: shapes, censoring/missing inputs, unknown workers, seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.errors import ConfigError
from stages.model.checkpoint import Checkpoint, Vocab, save_checkpoint
from stages.model.data import Normaliser
from stages.model.predictor import load_predictor
from stages.model.runtime_model import ModelConfig, RuntimeModel


@pytest.fixture
def checkpoint_path(tmp_path):
    torch.manual_seed(0)
    model = RuntimeModel(ModelConfig(num_workers=3, num_hosts=2, z_dim=4, hidden=16))
    vocab = Vocab((0, 1, 2), ("a", "b"), {0: "a", 1: "b", 2: "a"})
    ckpt = Checkpoint(model, Normaliser(np.log(0.05), 0.3), vocab, ("a", "b", "a"), {}, {})
    return save_checkpoint(tmp_path / "m.pt", ckpt)


def test_samples_are_positive_joint_draws_for_the_default_workers(checkpoint_path):
    pred = load_predictor(checkpoint_path, seed=0)
    pred.observe(np.array([0.05, 0.06, 0.04]), np.array([False, False, False]))
    x = pred.sample(128)
    assert x.shape == (128, 3) and x.dtype == torch.float32
    assert torch.all(x > 0) and torch.isfinite(x).all()
    assert 0.005 < float(x.median()) < 0.5


def test_unknown_workers_and_hosts_use_the_unknown_embedding(checkpoint_path):
    pred = load_predictor(checkpoint_path, workers=[0, 7, 8, 2], hosts=["a", "a", "new-host", "b"])
    assert pred.sample(4).shape == (4, 4)
    assert pred.params.emb.shape[0] == 4
    by_default = load_predictor(checkpoint_path, workers=[5])
    assert by_default.sample(2).shape == (2, 1)
    with pytest.raises(ConfigError):
        load_predictor(checkpoint_path, workers=[0, 1], hosts=["a"])


def test_an_iteration_of_the_wrong_size_is_a_clear_error(checkpoint_path):
    pred = load_predictor(checkpoint_path)
    with pytest.raises(ConfigError, match="predictor for 3 workers"):
        pred.observe(np.array([0.05, 0.06]), np.zeros(2, dtype=bool))


def test_censored_and_missing_entries_are_accepted(checkpoint_path):
    pred = load_predictor(checkpoint_path)
    for _ in range(5):
        pred.observe(np.array([0.05, np.nan, 0.09]), np.array([False, False, True]))
    ll, scored = pred.log_predictive(np.array([0.05, np.nan, 0.2]), np.array([False, False, True]))
    assert scored == 2 and np.isfinite(ll)
    assert torch.isfinite(pred.sample(8)).all()


def test_same_seed_same_samples(checkpoint_path):
    draws = []
    for _ in range(2):
        pred = load_predictor(checkpoint_path, seed=11)
        pred.observe(np.array([0.05, 0.06, 0.04]), np.zeros(3, dtype=bool))
        draws.append(pred.sample(32))
    torch.testing.assert_close(draws[0], draws[1])
