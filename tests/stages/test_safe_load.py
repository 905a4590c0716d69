"""bdsgd.stages.safe_load: checkpoints load without running code, and writes are atomic."""

from __future__ import annotations

import pytest
import torch
from bdsgd.stages.errors import CheckpointError
from bdsgd.stages.safe_load import load_plain, save_atomic


class Payload:  # a class instance: weights_only loading must refuse it
    pass


def test_round_trip(tmp_path):
    path = tmp_path / "state.pt"
    save_atomic({"x": torch.ones(2), "n": 3}, path)
    assert load_plain(path, "state")["n"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


def test_refuses_code_truncation_and_non_dicts(tmp_path):
    code = tmp_path / "code.pt"
    torch.save({"obj": Payload()}, code)
    with pytest.raises(CheckpointError, match="objects other than tensors"):
        load_plain(code, "state")
    truncated = tmp_path / "cut.pt"
    save_atomic({"x": torch.ones(100)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="not a readable state"):
        load_plain(truncated, "state")
    listed = tmp_path / "list.pt"
    torch.save([1, 2], listed)
    with pytest.raises(CheckpointError, match="not a bdsgd state"):
        load_plain(listed, "state")
    with pytest.raises(CheckpointError, match="no state"):
        load_plain(tmp_path / "missing.pt", "state")


def test_failed_write_leaves_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="cannot write"):
        save_atomic({"x": 1}, blocker / "state.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_a_save_that_fails_midway_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """The disk fills up while the new state is written: the old one still loads, unchanged,
    and no temporary file is left."""
    path = tmp_path / "server_state.pt"
    save_atomic({"next_iteration": 25, "x": torch.arange(3.0)}, path)
    real_save = torch.save

    def full_disk(payload, target):
        real_save(payload, target)
        with open(target, "r+b") as fh:  # a partial write, then the error
            fh.truncate(20)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="cannot write .*No space left on device"):
        save_atomic({"next_iteration": 50, "x": torch.zeros(3)}, path)
    monkeypatch.undo()
    old = load_plain(path, "server checkpoint")
    assert old["next_iteration"] == 25 and old["x"].tolist() == [0.0, 1.0, 2.0]
    assert [p.name for p in tmp_path.iterdir()] == ["server_state.pt"]
