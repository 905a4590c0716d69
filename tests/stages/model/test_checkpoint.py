"""Checkpoint files: round trip, plain weights_only loading, bad files, growing vocabularies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.errors import CheckpointError
from stages.model.checkpoint import (
    VERSION,
    Checkpoint,
    Vocab,
    grown_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from stages.model.data import Normaliser
from stages.model.predictor import predictor_from
from stages.model.runtime_model import ModelConfig, RuntimeModel


def _checkpoint() -> Checkpoint:
    torch.manual_seed(0)
    model = RuntimeModel(ModelConfig(num_workers=4, num_hosts=2, z_dim=4, hidden=16))
    vocab = Vocab((0, 1, 2, 3), ("a", "b"), {0: "a", 1: "b", 2: "a", 3: "b"})
    return Checkpoint(
        model, Normaliser(-3.0, 0.5), vocab, ("a", "b", "a", "b"), {"steps": 1}, {"val_nll": None}
    )


def test_round_trip_gives_the_same_predictions(tmp_path):
    ckpt = _checkpoint()
    path = save_checkpoint(tmp_path / "sub" / "m.pt", ckpt)
    loaded = load_checkpoint(path)
    assert loaded.vocab == ckpt.vocab and loaded.norm == ckpt.norm
    assert loaded.default_hosts == ckpt.default_hosts and loaded.summary == ckpt.summary
    a = predictor_from(ckpt, seed=3).sample(16)
    b = predictor_from(loaded, seed=3).sample(16)
    torch.testing.assert_close(a, b)
    assert not list(tmp_path.glob("sub/.tmp-*"))


def test_file_is_plain_data_for_weights_only_load(tmp_path):
    path = save_checkpoint(tmp_path / "m.pt", _checkpoint())
    payload = torch.load(path, weights_only=True)
    assert payload["format"] == "bdsgd-runtime-model" and payload["version"] == VERSION
    assert payload["model_config"]["num_workers"] == 4
    assert all(isinstance(v, torch.Tensor) for v in payload["state_dict"].values())


@pytest.mark.parametrize("version", [1, 2, 99])
def test_wrong_version_is_one_clear_error(tmp_path, version):
    path = save_checkpoint(tmp_path / "m.pt", _checkpoint())
    payload = torch.load(path, weights_only=True)
    torch.save({**payload, "version": version}, path)
    with pytest.raises(CheckpointError, match=f"version {version} is not supported"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "content", [b"", b"not a checkpoint at all", b"PK\x03\x04garbage"], ids=["empty", "text", "zip"]
)
def test_corrupt_file_is_one_clear_error(tmp_path, content):
    path = tmp_path / "m.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(path)


def test_truncated_file_and_foreign_payloads_are_errors(tmp_path):
    path = save_checkpoint(tmp_path / "m.pt", _checkpoint())
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match="not a bdsgd run-time model"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")


def test_state_with_a_missing_tensor_is_malformed(tmp_path):
    path = save_checkpoint(tmp_path / "m.pt", _checkpoint())
    payload = torch.load(path, weights_only=True)
    del payload["state_dict"]["combiner.to_loc.weight"]
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match="malformed.*Missing key"):
        load_checkpoint(path)


def test_growing_the_vocabulary_keeps_known_rows_and_starts_new_ones_unknown():
    old = _checkpoint()
    vocab = old.vocab.extended([("a", "c", "a", "b", "c", "a")])
    assert vocab.worker_ids == (0, 1, 2, 3, 4, 5) and vocab.host_names == ("a", "b", "c")
    model = RuntimeModel(
        ModelConfig(**{**old.model.cfg.to_dict(), "num_workers": 6, "num_hosts": 3})
    )
    model.load_state_dict(grown_state_dict(model, old.model))
    w_old, w_new = old.model.head.worker_emb.weight, model.head.worker_emb.weight
    torch.testing.assert_close(w_new[:5], w_old)
    torch.testing.assert_close(w_new[5:], w_old[0].expand(2, -1))
    np.testing.assert_array_equal(vocab.host_index(["c", "zzz"]).numpy(), [3, 0])


class _Payload:
    """Stands in for a pickled object that would run code when unpickled."""

    def __reduce__(self):
        return (print, ("code ran while loading",))


def test_a_checkpoint_holding_code_is_refused(tmp_path, capsys):
    path = tmp_path / "m.pt"
    torch.save({"format": "bdsgd-runtime-model", "version": 1, "x": _Payload()}, path)
    with pytest.raises(CheckpointError, match="objects other than tensors"):
        load_checkpoint(path)
    assert "code ran" not in capsys.readouterr().out
