"""A checkpoint ``fit`` marked unusable: ``bdsgd`` plays its simple peers from the first
iteration and says so in one line; a checkpoint without the mark is used."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bdsgd.stages.model.checkpoint import Checkpoint, Vocab, save_checkpoint
from bdsgd.stages.model.data import Normaliser
from bdsgd.stages.model.runtime_model import ModelConfig, RuntimeModel
from bdsgd.stages.policies.cutoff import EwmaCutoff
from bdsgd.stages.policies.registry import make_policy
from bdsgd.stages.policies.selfcheck import SelfChecking, self_check_report
from bdsgd.stages.simulate import replay
from bdsgd.stages.store import RunMatrix
from bdsgd.stages.stragglers import parse_stragglers

HOSTS = ("host0",) * 4


def write_checkpoint(path, summary: dict):
    torch.manual_seed(0)
    model = RuntimeModel(ModelConfig(num_workers=4, num_hosts=1, z_dim=4, hidden=16))
    vocab = Vocab((0, 1, 2, 3), ("host0",), dict.fromkeys(range(4), "host0"))
    ckpt = Checkpoint(model, Normaliser(np.log(0.16), 0.3), vocab, HOSTS, {}, summary)
    return save_checkpoint(path, ckpt)


def job(iterations: int = 60) -> RunMatrix:
    x = parse_stragglers("job", seed=1).delays(iterations, 4)
    full = np.ones(x.shape, dtype=bool)
    return RunMatrix("job", x, ~full, full, HOSTS)


REASON = "the model is not calibrated on held-out data: profile longer, or use ecdf"


@pytest.mark.parametrize("spec", ["bdsgd", "bdsgd:unchecked", "bdsgd:fixed"])
def test_an_unusable_checkpoint_plays_the_peer_from_iteration_zero(tmp_path, capsys, spec):
    path = write_checkpoint(tmp_path / "m.pt", {"usable": False, "unusable_reason": REASON})
    policy = make_policy(spec, 4, path, list(HOSTS), seed=0)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "marked unusable (the model is not calibrated" in err and "simple peers" in err
    assert isinstance(policy, SelfChecking) and not policy.trusted
    run = job()
    peer = EwmaCutoff(4, num_samples=policy.experts[1].num_samples, seed=0)
    played = replay(policy, run, start=0, overhead_s=0.0)
    alone = replay(peer, run, start=0, overhead_s=0.0)
    assert played.columns["peer"][0] == "ewma"
    assert played.columns["c"][0] == alone.columns["c"][0]
    assert all(p is not None for p in played.columns["peer"])  # never the model
    report = self_check_report(policy)
    assert report["leaned_share"] == 1.0 and report["first_leaned"] == 0
    assert report["model_usable"] is False


@pytest.mark.parametrize("summary", [{}, {"usable": True}])
def test_a_checkpoint_without_the_mark_or_marked_usable_is_used(tmp_path, capsys, summary):
    path = write_checkpoint(tmp_path / "m.pt", summary)
    policy = make_policy("bdsgd", 4, path, list(HOSTS), seed=0)
    assert "unusable" not in capsys.readouterr().err
    assert policy.trusted and policy.leader == 0
    played = replay(policy, job(5), start=0, overhead_s=0.0)
    assert played.columns["peer"][0] is None


def test_an_uncalibrated_checkpoint_puts_the_model_on_probation(tmp_path, capsys):
    summary = {"usable": False, "unusable_reason": REASON, "probation": True}
    policy = make_policy("bdsgd", 4, write_checkpoint(tmp_path / "m.pt", summary), list(HOSTS))
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "marked uncalibrated" in err and "until the model's own record" in err
    assert isinstance(policy, SelfChecking) and not policy.trusted and policy.probation
    played = replay(policy, job(), start=0, overhead_s=0.0)
    assert played.columns["peer"][0] == "ewma"  # the peers decide first
    report = self_check_report(policy)
    assert report["on_probation"] and report["rates"][policy.name] > 0  # the model is scored
