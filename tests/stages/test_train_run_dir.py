"""The train stage's run directory: what ``--out`` may be, ``--force``, the lock, the undo of a
rejected run, and what ``--resume`` trusts of a run directory (not its workload's code)."""

from __future__ import annotations

import json

import pytest
from bdsgd.schemas.run_dir import check_output_dir
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.run_dir import CONFIG_FILE, RUN_FILES, open_new_run
from bdsgd.stages.run_lock import LOCK_FILE, RunDirLock
from bdsgd.stages.train import TrainConfig, resume_config


def config(tmp_path, **overrides) -> TrainConfig:
    values = dict(
        workers=2, iterations=4, policy="static:1", traces=tmp_path / "t", out=tmp_path / "o"
    )
    return TrainConfig(**{**values, **overrides})


def prepare_run_dir(cfg: TrainConfig):
    """A new run in ``cfg.out``: its config written, the lock taken; returns the undo."""
    lock, undo = open_new_run(cfg.out, cfg.to_json(), cfg.force)
    lock.release()
    return undo


def snapshot(path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_a_new_path_is_created_and_undone_level_by_level(tmp_path):
    cfg = config(tmp_path, out=tmp_path / "a" / "b" / "run")
    undo = prepare_run_dir(cfg)
    assert json.loads((cfg.out / CONFIG_FILE).read_text())["policy"] == "static:1"
    undo()
    assert not (tmp_path / "a").exists()


def test_an_empty_directory_is_used_and_kept_on_undo(tmp_path):
    cfg = config(tmp_path)
    cfg.out.mkdir()
    undo = prepare_run_dir(cfg)
    assert (cfg.out / CONFIG_FILE).is_file()
    undo()
    assert cfg.out.is_dir() and not any(cfg.out.iterdir())


def test_a_directory_of_other_files_is_refused_and_left_alone(tmp_path):
    """Files bdsgd did not write are never overwritten, --force or not (a summary.json that
    is not a run's is someone else's)."""
    cfg = config(tmp_path)
    cfg.out.mkdir()
    (cfg.out / "notes.txt").write_text("the user's own notes")
    (cfg.out / "summary.json").write_text("{}")
    for force in (False, True):
        with pytest.raises(ConfigError, match="did not write \\(notes.txt, summary.json\\)"):
            prepare_run_dir(config(tmp_path, force=force))
    assert snapshot(cfg.out) == {"notes.txt": b"the user's own notes", "summary.json": b"{}"}


@pytest.mark.parametrize("state", ["engine_state.pt", "checkpoint.pt"])
def test_a_directory_holding_a_run_points_to_resume(tmp_path, state):
    cfg = config(tmp_path)
    cfg.out.mkdir()
    (cfg.out / state).write_bytes(b"state")
    with pytest.raises(ConfigError, match=f"already holds a run: pass --resume {cfg.out}"):
        prepare_run_dir(cfg)
    assert snapshot(cfg.out) == {state: b"state"}  # (not even a lock file)


def test_force_replaces_a_previous_runs_files(tmp_path):
    cfg = config(tmp_path, force=True)
    cfg.out.mkdir()
    for name in RUN_FILES:
        (cfg.out / name).write_text("old")
    (cfg.out / "summary.json").write_text(json.dumps({"kind": "train", "run_id": "old"}))
    (cfg.out / CONFIG_FILE).write_text(json.dumps(config(tmp_path).to_json()))
    (cfg.out / "log").mkdir()
    (cfg.out / "log" / "rows-000000.pt").write_text("old")
    prepare_run_dir(cfg)
    assert sorted(p.name for p in cfg.out.iterdir()) == [CONFIG_FILE, LOCK_FILE]
    assert json.loads((cfg.out / CONFIG_FILE).read_text())["force"] is True


def test_a_refused_force_beside_a_live_run_changes_no_byte(tmp_path):
    """Another run holds the lock: --force is refused as 'in use' and the directory, config
    included, is exactly as it was."""
    cfg = config(tmp_path)
    prepare_run_dir(cfg)
    (cfg.out / "checkpoint.pt").write_bytes(b"live")
    live = RunDirLock(cfg.out).acquire()
    try:
        before = snapshot(cfg.out)
        other = config(tmp_path, force=True, workers=3, policy="full")
        with pytest.raises(ConfigError, match="is in use by another run"):
            prepare_run_dir(other)
        assert snapshot(cfg.out) == before
    finally:
        live.release()


def test_an_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "o").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a run directory"):
        prepare_run_dir(config(tmp_path))
    assert (tmp_path / "o").read_text() == "x"


def test_an_unwritable_out_is_one_error(tmp_path):
    """A path under a file cannot be created, whoever runs the test (root included)."""
    (tmp_path / "file").write_text("x")
    cfg = config(tmp_path, out=tmp_path / "file" / "run")
    with pytest.raises(ConfigError, match="is a file, not a run directory|cannot make"):
        prepare_run_dir(cfg)


# -- resume: the run directory does not name code --------------------------------------------
def write_run_dir(tmp_path, **changes) -> TrainConfig:
    cfg = config(tmp_path)
    cfg.out.mkdir()
    data = {**cfg.to_json(), **changes}
    (cfg.out / CONFIG_FILE).write_text(json.dumps(data))
    return cfg


def test_resume_of_a_code_workload_asks_for_it_again(tmp_path):
    cfg = write_run_dir(tmp_path, workload="somewhere:make")
    with pytest.raises(ConfigError, match="'somewhere:make', which is code: pass --workload"):
        resume_config(cfg.out)
    with pytest.raises(ConfigError, match="not --workload 'other:make'"):
        resume_config(cfg.out, workload="other:make")
    assert resume_config(cfg.out, workload="somewhere:make").workload == "somewhere:make"


def test_resume_of_a_built_in_workload_needs_no_flag_but_checks_one_given(tmp_path):
    cfg = write_run_dir(tmp_path)
    assert resume_config(cfg.out).workload == "mlp"
    assert resume_config(cfg.out, workload="mlp").workload == "mlp"
    with pytest.raises(ConfigError, match="names workload 'mlp', not --workload 'cnn'"):
        resume_config(cfg.out, workload="cnn")


@pytest.mark.parametrize(
    "content", ['{"workers": 2, "bogus": 1}', "[1, 2]", "not json", '{"workers": 2}']
)
def test_a_tampered_config_is_one_error(tmp_path, content):
    cfg = write_run_dir(tmp_path)
    (cfg.out / CONFIG_FILE).write_text(content)
    with pytest.raises(ConfigError, match="config|JSON"):
        resume_config(cfg.out)


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (dict(timeout_s=float("nan")), "--timeout must be a finite number"),
        (dict(timeout_s=float("inf")), "--timeout must be a finite number"),
        (dict(lr=float("nan")), "--lr must be a finite number"),
        (dict(micro_batches=0), "--micro-batches must be >= 1, got 0"),
        (dict(batch_size=2, micro_batches=4), "--batch-size 2 is smaller than --micro-batches 4"),
    ],
)
def test_non_finite_numbers_are_refused(tmp_path, bad, needle):
    with pytest.raises(ConfigError, match=needle):
        config(tmp_path, **bad)


def test_an_unreadable_out_is_one_line(tmp_path, monkeypatch):
    """(Reading a directory's names fails as a user without read permission on it would:
    these tests run as root, which chmod does not stop.)"""
    cfg = config(tmp_path)
    cfg.out.mkdir()

    def unreadable(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(cfg.out), "iterdir", unreadable)
    with pytest.raises(ConfigError, match="cannot read the run directory .*: Permission denied"):
        prepare_run_dir(cfg)
    with pytest.raises(ConfigError, match="cannot read --out .*: Permission denied"):
        check_output_dir(cfg.out, "report.json", "report", "report.md")
