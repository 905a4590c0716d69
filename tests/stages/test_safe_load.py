"""bdsgd.stages.safe_load: checkpoints load without running code, and writes are atomic."""

from __future__ import annotations

import pytest
import torch
from bdsgd.stages.errors import CheckpointError
from bdsgd.stages.safe_load import load_plain, save_atomic

from tests.full_disk import Disk


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


def test_save_atomic_on_a_full_disk_is_a_checkpoint_error_and_keeps_the_old_file(
    tmp_path, monkeypatch
):
    """The disk fills up while the new state is written: torch.save raises RuntimeError (its
    zip writer), the error says why, the old state still loads, no temporary file is left."""
    disk = Disk(tmp_path / "disk", monkeypatch)
    try:
        path = disk.path / "state.pt"
        save_atomic({"x": torch.zeros(4)}, path)
        disk.fill()
        with pytest.raises(CheckpointError, match="No space left on device"):
            save_atomic({"x": torch.zeros(100_000)}, path)
        assert torch.equal(torch.load(path, weights_only=True)["x"], torch.zeros(4))
        assert not list(disk.path.glob(".tmp-*"))
    finally:
        disk.unmount()


def test_save_atomic_does_not_rename_when_then_fails(tmp_path):
    path = tmp_path / "state.pt"

    def then() -> None:
        raise CheckpointError("the rows it counts were not written")

    with pytest.raises(CheckpointError, match="not written"):
        save_atomic({"x": torch.zeros(4)}, path, then)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", [b"", b"hello\n", b"a,b\n1,2\n", b"PK\x03\x04garbage"])
def test_a_file_torch_did_not_write_is_named_so(tmp_path, content):
    path = tmp_path / "notes.txt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        load_plain(path, "checkpoint")
    assert str(err.value) == f"{path}: not a readable checkpoint (not a torch file)"
