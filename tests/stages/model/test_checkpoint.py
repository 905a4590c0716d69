"""Checkpoint files: round trip, plain weights_only loading, bad and crafted files, growing
vocabularies, never replacing a file bdsgd did not write."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from bdsgd.stages.errors import CheckpointError
from bdsgd.stages.model.checkpoint import (
    VERSION,
    WITH_DROPS,
    WITH_REGIME,
    WITHOUT_DROPS,
    Checkpoint,
    Vocab,
    check_writable,
    grown_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from bdsgd.stages.model.data import ANCHOR_Q, Normaliser
from bdsgd.stages.model.predictor import predictor_from
from bdsgd.stages.model.runtime_model import ModelConfig, RuntimeModel


def _checkpoint(**cfg) -> Checkpoint:
    """A small untrained checkpoint; ``cfg``: ModelConfig fields other than the defaults."""
    torch.manual_seed(0)
    model = RuntimeModel(ModelConfig(num_workers=4, num_hosts=2, z_dim=4, hidden=16, **cfg))
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
    assert payload["format"] == "bdsgd-runtime-model" and payload["version"] == WITHOUT_DROPS == 5
    assert payload["model_config"]["num_workers"] == 4
    assert all(isinstance(v, torch.Tensor) for v in payload["state_dict"].values())


def test_the_usable_mark_is_plain_metadata_and_defaults_to_usable(tmp_path):
    """``fit`` writes ``usable``/``unusable_reason`` into the summary; a checkpoint without
    them (written before the mark, or by hand) reads as usable."""
    unmarked = load_checkpoint(save_checkpoint(tmp_path / "a.pt", _checkpoint()))
    assert unmarked.usable and unmarked.unusable_reason is None
    reason = "the model is not calibrated on held-out data: profile longer"
    ckpt = dataclasses.replace(_checkpoint(), summary={"usable": False, "unusable_reason": reason})
    path = save_checkpoint(tmp_path / "b.pt", ckpt)
    summary = torch.load(path, weights_only=True)["summary"]
    assert summary["usable"] is False and summary["unusable_reason"] == reason
    loaded = load_checkpoint(path)
    assert not loaded.usable and loaded.unusable_reason == reason
    ok = dataclasses.replace(_checkpoint(), summary={"usable": True, "unusable_reason": None})
    assert load_checkpoint(save_checkpoint(tmp_path / "c.pt", ok)).usable


@pytest.mark.parametrize("version", [1, 3, 9, 99, 5.0, "5"])
def test_wrong_version_is_one_clear_error(tmp_path, version):
    path = save_checkpoint(tmp_path / "m.pt", _checkpoint())
    payload = torch.load(path, weights_only=True)
    torch.save({**payload, "version": version}, path)
    with pytest.raises(CheckpointError, match=f"version {re.escape(repr(version))} is not supp"):
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


def _crafted(tmp_path, edit) -> Path:
    """A checkpoint file whose payload ``edit`` has changed in place."""
    path = save_checkpoint(tmp_path / "m.pt", _checkpoint())
    payload = torch.load(path, weights_only=True)
    edit(payload)
    torch.save(payload, path)
    return path


def _set(*keys, value):
    def edit(payload):
        target = payload
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


CRAFTED = {
    "zero scale": (_set("norm", "scale", value=0.0), "norm scale 0.0"),
    "negative scale": (_set("norm", "scale", value=-1.0), "norm scale -1.0"),
    "nan scale": (_set("norm", "scale", value=float("nan")), "norm scale nan"),
    "nan loc": (_set("norm", "loc", value=float("nan")), "norm loc nan"),
    "infinite loc": (_set("norm", "loc", value=float("inf")), "norm loc inf"),
    "nan weights": (
        _set("state_dict", "combiner.to_loc.weight", value=torch.full((4, 16), float("nan"))),
        "combiner.to_loc.weight holds NaN",
    ),
    "absurd workers": (_set("model_config", "num_workers", value=10**9), "num_workers 1000000000"),
    "absurd hidden": (_set("model_config", "hidden", value=10**6), "hidden 1000000"),
    "float size": (_set("model_config", "z_dim", value=4.5), "z_dim 4.5"),
    "sizes the weights do not back": (
        _set("model_config", "num_workers", value=2**20),
        r"worker_emb.weight has shape \[5, 16\]",
    ),
    "vocabulary beyond the embedding": (
        _set("worker_ids", value=[0, 1, 2, 3, 4, 5]),
        "worker_ids and host_names do not match",
    ),
    "nan recalibration": (_set("common", value=[float("nan"), 0.0, 1.0, 1.0]), "common"),
    "negative widening": (_set("common", value=[0.0, 0.0, -1.0, 1.0]), "common"),
    "nan level spread": (_set("norm", "level_sd", value=float("nan")), "norm level_sd nan"),
    "negative level dof": (_set("norm", "level_dof", value=-1), "norm level_dof -1"),
    "fractional level dof": (_set("norm", "level_dof", value=2.5), "norm level_dof 2.5"),
    "boolean level dof": (_set("norm", "level_dof", value=True), "norm level_dof True"),
    "unknown feature count": (_set("model_config", "num_features", value=10), "num_features 10"),
    "float feature count": (_set("model_config", "num_features", value=12.0), "num_features 12.0"),
    "position features the weights lack": (
        _set("model_config", "num_features", value=8),
        'Unexpected key.*"head.position_w"',
    ),
}


@pytest.mark.parametrize("edit, reason", CRAFTED.values(), ids=CRAFTED.keys())
def test_a_crafted_checkpoint_is_one_malformed_line_naming_the_problem(tmp_path, edit, reason):
    path = _crafted(tmp_path, edit)
    with pytest.raises(CheckpointError, match=f"malformed checkpoint .*{reason}") as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value)


def test_an_existing_non_checkpoint_file_is_never_replaced(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("my notes")
    with pytest.raises(CheckpointError, match="exists and is not a bdsgd checkpoint"):
        check_writable(precious)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")  # readable, not ours
    with pytest.raises(CheckpointError, match="not a bdsgd checkpoint"):
        check_writable(tmp_path / "other.pt")
    assert precious.read_text() == "my notes"


@pytest.mark.parametrize("text", ["hello\n", "a,b\n1,2\n"])
def test_a_text_file_read_as_a_checkpoint_is_one_line(tmp_path, text):
    """Read as pickle opcodes, text raised KeyError or IndexError: a traceback before."""
    path = tmp_path / "notes.txt"
    path.write_text(text)
    with pytest.raises(CheckpointError, match="exists and is not a bdsgd checkpoint"):
        check_writable(path)
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(path)
    assert path.read_text() == text


def test_a_diverged_fit_writes_nothing(tmp_path):
    """Its own loader would refuse NaN weights: the fit fails instead of writing them."""
    ckpt = _checkpoint()
    with torch.no_grad():
        next(iter(ckpt.model.parameters())).fill_(float("nan"))
    with pytest.raises(CheckpointError, match="the fit diverged, nothing written"):
        save_checkpoint(tmp_path / "m.pt", ckpt)
    assert list(tmp_path.iterdir()) == []


def test_an_earlier_checkpoint_of_any_version_may_be_replaced(tmp_path):
    check_writable(save_checkpoint(tmp_path / "m.pt", _checkpoint()))
    older = _crafted(tmp_path, _set("version", value=1))
    check_writable(older)


def test_checking_creates_no_folder(tmp_path):
    check_writable(tmp_path / "new" / "sub" / "m.pt")
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        check_writable(tmp_path / "file" / "m.pt")


def test_an_anchored_normalisation_round_trips_and_an_older_file_reads_unanchored(tmp_path):
    torch.manual_seed(0)
    model = RuntimeModel(ModelConfig(num_workers=4, num_hosts=2, z_dim=4, hidden=16))
    vocab = Vocab((0, 1, 2, 3), ("a", "b"))
    norm = Normaliser(-3.0, 0.5, anchored=True, level_sd=0.8, level_dof=3)
    ckpt = Checkpoint(model, norm, vocab, ("a", "b", "a", "b"), {}, {})
    assert load_checkpoint(save_checkpoint(tmp_path / "m.pt", ckpt)).norm == norm
    normal = dataclasses.replace(ckpt, norm=dataclasses.replace(norm, level_dof=0))
    payload = torch.load(save_checkpoint(tmp_path / "n.pt", normal), weights_only=True)
    assert "level_dof" not in payload["norm"]  # as an anchored file before the t reads
    older = dataclasses.replace(ckpt, norm=Normaliser(-3.0, 0.5))
    payload = torch.load(save_checkpoint(tmp_path / "old.pt", older), weights_only=True)
    assert set(payload["norm"]) == {"loc", "scale"}  # what a file before the anchor holds
    assert load_checkpoint(tmp_path / "old.pt").norm == Normaliser(-3.0, 0.5, False, 0.0)


def test_a_checkpoint_from_before_the_position_features_loads_and_predicts(tmp_path):
    """A version 4 file (its model_config has no num_features) was written with the 8 history
    features: it loads as such, and its predictor computes those 8 (not the 12 of a new fit)."""
    torch.manual_seed(0)
    old_cfg = ModelConfig(
        num_workers=4, num_hosts=2, z_dim=4, hidden=16, num_features=8, recovery=False
    )
    old = dataclasses.replace(_checkpoint(), model=RuntimeModel(old_cfg))
    path = save_checkpoint(tmp_path / "m.pt", old)
    payload = torch.load(path, weights_only=True)
    del payload["model_config"]["num_features"]
    torch.save({**payload, "version": 4}, path)
    loaded = load_checkpoint(path)
    assert loaded.model.cfg.num_features == 8 == _checkpoint().model.cfg.num_features - 4
    predictors = [predictor_from(c, seed=3) for c in (loaded, old)]
    for predictor in predictors:
        predictor.observe(np.full(4, 0.05), np.zeros(4, dtype=bool))
    assert predictors[0].hist.features()[2].shape == (4, 8)
    torch.testing.assert_close(predictors[0].sample(8), predictors[1].sample(8))


def test_a_model_grown_from_one_without_the_position_predicts_as_it_did(tmp_path):
    """fit --init from a version 4 checkpoint: the new model has the position features, with
    weights 0, so before any step it predicts what the prior did."""
    torch.manual_seed(0)
    cfg8 = ModelConfig(
        num_workers=4, num_hosts=2, z_dim=4, hidden=16, num_features=8, recovery=False
    )
    old = dataclasses.replace(_checkpoint(), model=RuntimeModel(cfg8))
    model = RuntimeModel(dataclasses.replace(cfg8, num_features=12))
    model.load_state_dict(grown_state_dict(model, old.model))
    assert not model.head.position_w.any()
    assert_predicts_alike(old, dataclasses.replace(old, model=model))


def test_a_checkpoint_from_before_the_drop_loads_without_it_and_predicts_as_written(tmp_path):
    """A model without drops (nor the regime features) is written as before them (version 5,
    no recovery in its model_config): it loads as such, and its predictor draws what the model
    written draws."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_workers=4, num_hosts=2, z_dim=4, hidden=16, recovery=False,
                      num_features=12)  # fmt: skip
    old = dataclasses.replace(_checkpoint(), model=RuntimeModel(cfg))
    path = save_checkpoint(tmp_path / "m.pt", old)
    payload = torch.load(path, weights_only=True)
    assert payload["version"] == 5 and "recovery" not in payload["model_config"]  # as written
    loaded = load_checkpoint(path)
    assert loaded.model.cfg.recovery is False and loaded.model.head.recovery is None
    predictors = [predictor_from(c, seed=3) for c in (loaded, old)]
    for predictor in predictors:
        predictor.observe(np.full(4, 0.05), np.zeros(4, dtype=bool))
    assert predictors[0].base.drop is None
    torch.testing.assert_close(predictors[0].sample(8), predictors[1].sample(8))
    # one with drops is written as version 6
    cfg = dataclasses.replace(cfg, recovery=True)
    dropping = dataclasses.replace(_checkpoint(), model=RuntimeModel(cfg))
    written = torch.load(save_checkpoint(tmp_path / "n.pt", dropping), weights_only=True)
    assert written["version"] == WITH_DROPS == 6 and written["model_config"]["recovery"] is True
    assert load_checkpoint(tmp_path / "n.pt").model.cfg.recovery
    # a recovery flag that is not a bool is refused
    payload["model_config"]["recovery"] = 1
    torch.save({**payload, "version": 6}, path)
    with pytest.raises(CheckpointError, match="recovery 1 is not true or false"):
        load_checkpoint(path)


def test_a_checkpoint_from_before_the_regime_features_predicts_as_written(tmp_path):
    """A 12-feature model (versions 5 and 6) loads as such and its predictor computes those 12,
    without the host-regime filter; a 14-feature one is written as version 7."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_workers=4, num_hosts=2, z_dim=4, hidden=16, num_features=12)
    old = dataclasses.replace(_checkpoint(), model=RuntimeModel(cfg))
    path = save_checkpoint(tmp_path / "m.pt", old)
    assert torch.load(path, weights_only=True)["version"] == WITHOUT_DROPS
    loaded = load_checkpoint(path)
    predictors = [predictor_from(c, seed=3) for c in (loaded, old)]
    for predictor in predictors:
        predictor.observe(np.full(4, 0.05), np.zeros(4, dtype=bool))
    assert predictors[0].hist.regime is None and predictors[0].hist.features()[2].shape == (4, 12)
    torch.testing.assert_close(predictors[0].sample(8), predictors[1].sample(8))
    new = save_checkpoint(tmp_path / "n.pt", _checkpoint(num_features=14))
    assert torch.load(new, weights_only=True)["version"] == WITH_REGIME == 7
    assert predictor_from(load_checkpoint(new), seed=3).hist.regime is not None


@pytest.mark.parametrize("recovery", [False, True])
def test_a_model_grown_from_one_without_the_regime_features_predicts_as_it_did(recovery):
    """fit --init from a 12-feature checkpoint (with or without drops): the new features'
    weights start at 0, the shared ones and the drop's, so it predicts what the prior did."""
    torch.manual_seed(0)
    cfg12 = ModelConfig(num_workers=4, num_hosts=2, z_dim=4, hidden=16, num_features=12,
                        recovery=recovery)  # fmt: skip
    old = dataclasses.replace(_checkpoint(), model=RuntimeModel(cfg12))
    if recovery:  # weights that matter, so that a misplaced row would show
        with torch.no_grad():
            old.model.head.recovery.weight.normal_(0.0, 0.1)
            old.model.head.recovery.bias.normal_(0.0, 0.5)
            old.model.head.position_w.normal_(0.0, 0.1)
    model = RuntimeModel(dataclasses.replace(cfg12, num_features=14))
    model.load_state_dict(grown_state_dict(model, old.model))
    assert not model.head.position_w[:, 4:].any()
    assert_predicts_alike(old, dataclasses.replace(old, model=model))


def assert_predicts_alike(old: Checkpoint, grown: Checkpoint) -> None:
    """The two checkpoints' predictors draw the same after the same five iterations."""
    predictors = [predictor_from(c, seed=3) for c in (old, grown)]
    for t in range(5):
        for predictor in predictors:
            predictor.observe(np.full(4, 0.05 * (1 + t % 2)), np.zeros(4, dtype=bool))
    torch.testing.assert_close(predictors[0].sample(32), predictors[1].sample(32))


def test_a_fit_anchored_at_the_quartile_is_version_8_and_keeps_its_quantile(tmp_path):
    """norm["anchor_q"] is written (version 8: an older bdsgd would anchor at the median) and
    read back; a checkpoint without it anchors at the median."""
    anchored = Normaliser(np.log(0.2), 0.3, True, 0.1, 3, ANCHOR_Q)
    path = save_checkpoint(tmp_path / "q.pt", dataclasses.replace(_checkpoint(), norm=anchored))
    payload = torch.load(path, weights_only=True)
    assert payload["version"] == VERSION == 8 and payload["norm"]["anchor_q"] == ANCHOR_Q
    predictor = predictor_from(load_checkpoint(path), seed=0)
    assert predictor.norm.anchor_q == ANCHOR_Q
    predictor.observe(np.array([0.4, 0.17, 0.18, 1.0]), np.zeros(4, dtype=bool))
    assert predictor.norm.loc == pytest.approx(np.quantile(np.log([0.4, 0.17, 0.18, 1.0]), 0.25))
    median = Normaliser(np.log(0.2), 0.3, True, 0.1, 3)
    old = save_checkpoint(tmp_path / "m.pt", dataclasses.replace(_checkpoint(), norm=median))
    assert "anchor_q" not in torch.load(old, weights_only=True)["norm"]
    assert load_checkpoint(old).norm.anchor_q == 0.5


def test_a_summary_that_is_not_a_mapping_is_a_malformed_checkpoint(tmp_path):
    path = save_checkpoint(tmp_path / "m.pt", _checkpoint())
    payload = torch.load(path, weights_only=True)
    torch.save({**payload, "summary": ["usable", False]}, path)
    with pytest.raises(CheckpointError, match="malformed checkpoint .summary is a list"):
        load_checkpoint(path)
