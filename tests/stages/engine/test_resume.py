"""Checkpoints whose iteration log's older rows live in segment files: what is written, what a
resume reads back (the whole log), bad segments, ``--force`` cleanup, and a real run resumed."""

from __future__ import annotations

import pytest
import torch
from bdsgd.stages.engine import resume as K
from bdsgd.stages.engine.launch import run_engine
from bdsgd.stages.engine.resume import (
    STATE_FILE,
    Checkpointer,
    remove_segments,
    with_whole_log,
)
from bdsgd.stages.errors import CheckpointError
from bdsgd.stages.policies.asynchronous import KAsync
from bdsgd.stages.train import load_state

from tests.stages.engine import engine_config

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def small_segments(monkeypatch):
    """Segments of 4 rows, written once 2 later rows exist."""
    monkeypatch.setattr(K, "SEGMENT_ROWS", 4)
    monkeypatch.setattr(K, "SETTLE_ROWS", 2)


def log_of(n: int) -> dict[str, list]:
    return {"iteration": list(range(n)), "loss": [0.5 * t for t in range(n)], "policy": ["p"] * n}


def saved(run_dir, n: int, ckpt: Checkpointer) -> dict:
    ckpt.save({"version": 3, "next_iteration": n, "log": log_of(n)})
    return torch.load(run_dir / STATE_FILE, weights_only=True)


def test_settled_rows_move_into_segments_and_the_whole_log_reads_back(tmp_path, small_segments):
    ckpt = Checkpointer(tmp_path)
    state = saved(tmp_path, 5, ckpt)  # 5 rows: 4 + 1 later, not yet settled
    assert state["log_segments"] == 0 and state["log"] == log_of(5)
    state = saved(tmp_path, 11, ckpt)  # rows 0-3 and 4-7 settled (2 later rows each)
    assert state["log_segments"] == 2 and state["log"]["iteration"] == [8, 9, 10]
    assert sorted(p.name for p in (tmp_path / "log").iterdir()) == ["rows-000000.pt",
                                                                    "rows-000001.pt"]  # fmt: skip
    assert with_whole_log(tmp_path, state)["log"] == log_of(11)


def test_a_late_value_in_an_unsettled_row_is_kept(tmp_path, small_segments):
    """A held-out loss filled in after its row was checkpointed (the collective engine's)."""
    ckpt = Checkpointer(tmp_path)
    log = log_of(5)
    ckpt.save({"log": log})
    log["loss"][4] = -1.0
    log = {k: v + log_of(7)[k][5:] for k, v in log.items()}
    ckpt.save({"log": log})
    state = load_state_plain(tmp_path)
    assert with_whole_log(tmp_path, state)["log"]["loss"][4] == -1.0


def load_state_plain(run_dir) -> dict:
    return torch.load(run_dir / STATE_FILE, weights_only=True)


@pytest.mark.parametrize("damage", ["missing", "short", "foreign"])
def test_a_missing_or_foreign_segment_is_a_checkpoint_error(tmp_path, small_segments, damage):
    ckpt = Checkpointer(tmp_path)
    state = saved(tmp_path, 11, ckpt)
    segment = tmp_path / "log" / "rows-000001.pt"
    if damage == "missing":
        segment.unlink()
    elif damage == "short":
        torch.save({k: v[:2] for k, v in log_of(4).items()}, segment)
    else:
        torch.save({"other": [1, 2, 3, 4]}, segment)
    with pytest.raises(CheckpointError, match="rows-000001"):
        with_whole_log(tmp_path, state)


def test_force_cleanup_removes_only_the_segments(tmp_path, small_segments):
    saved(tmp_path, 11, Checkpointer(tmp_path))
    (tmp_path / "log" / "notes.txt").write_text("the user's")
    remove_segments(tmp_path)
    assert [p.name for p in (tmp_path / "log").iterdir()] == ["notes.txt"]
    (tmp_path / "log" / "notes.txt").unlink()
    saved(tmp_path, 11, Checkpointer(tmp_path))
    remove_segments(tmp_path)
    assert not (tmp_path / "log").exists()


def test_a_run_resumed_from_a_segmented_checkpoint_has_its_whole_log(tmp_path, small_segments):
    """40 iterations checkpointed every 5 (segments of 4 rows), then resumed to 60: the state
    read back holds every row, the resumed run's log continues it, and the segments the first
    run wrote are not rewritten."""
    cfg = engine_config(iterations=40, record_batch=5, stragglers="none")
    run = tmp_path / "run"
    first = run_engine(cfg, KAsync(2), tmp_path / "traces", lambda t, r: None, run)
    state = load_state(run)
    assert state["log_segments"] >= 8
    assert state["log"]["iteration"] == list(range(40)) == first.log["iteration"]
    assert state["log"]["loss"] == first.log["loss"]
    early = (run / "log" / "rows-000000.pt").stat().st_mtime_ns
    more = engine_config(iterations=60, record_batch=5, stragglers="none")
    second = run_engine(more, KAsync(2), tmp_path / "traces", lambda t, r: None, run,
                        resume=state)  # fmt: skip
    assert second.log["iteration"] == list(range(60))
    assert load_state(run)["log"]["iteration"] == list(range(60))
    assert (run / "log" / "rows-000000.pt").stat().st_mtime_ns == early
    assert sorted(p.name for p in run.iterdir()) == sorted(["log", STATE_FILE])
