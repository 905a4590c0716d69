"""``bdsgd report`` through click: exit codes, output lines, --json."""

from __future__ import annotations

import json
from pathlib import Path

from bdsgd.schemas.run_dir import iterations_table, write_run_dir
from click.testing import CliRunner

from bdsgd_cli.main import cli


def _run_dir(path: Path) -> Path:
    cols = {
        "policy": ["static:3"] * 5,
        "iteration": list(range(5)),
        "wall_s": [0.1, 0.2, 0.3, 0.4, 0.5],
        "iteration_s": [0.1] * 5,
        "c": [3] * 5,
        "workers": [4] * 5,
        "decision_ms": [0.01] * 5,
    }
    summary = {
        "kind": "train",
        "traces": str(path / "no-traces"),
        "run_id": "r",
        "policy": "static:3",
    }
    write_run_dir(path, summary, iterations_table(cols))
    return path


def test_report_writes_index_and_json(tmp_path):
    run = _run_dir(tmp_path / "run")
    out = tmp_path / "report"
    result = CliRunner().invoke(cli, ["report", str(run), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["index"] == str(out / "index.md")
    assert len(payload["plots"]) >= 3 and all(Path(p).is_file() for p in payload["plots"])
    assert "warning:" in result.stderr  # the trace store is missing: plots skipped, not fatal


def test_report_on_non_run_dir_exits_nonzero_with_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["report", str(tmp_path), "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert result.stderr.startswith("error:") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output


def test_report_needs_a_run_dir_and_out(tmp_path):
    assert CliRunner().invoke(cli, ["report", "--out", str(tmp_path)]).exit_code != 0
    assert CliRunner().invoke(cli, ["report", str(tmp_path)]).exit_code != 0


def test_report_refuses_a_foreign_out_in_one_line_and_rewrites_its_own(tmp_path):
    run = _run_dir(tmp_path / "run")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "index.md").write_text("# my notes\n")
    (mine / "other.txt").write_text("keep me\n")
    result = CliRunner().invoke(cli, ["report", str(run), "--out", str(mine)])
    assert result.exit_code != 0
    assert result.stderr.startswith("error:") and result.stderr.count("\n") == 1
    assert "not empty" in result.stderr and "Traceback" not in result.output
    assert (mine / "index.md").read_text() == "# my notes\n"
    assert sorted(p.name for p in mine.iterdir()) == ["index.md", "other.txt"]

    out = tmp_path / "report"
    for _ in range(2):  # the second run rewrites the first one's directory
        result = CliRunner().invoke(cli, ["report", str(run), "--out", str(out)])
        assert result.exit_code == 0, result.output


def test_report_on_a_killed_train_run_reports_its_checkpointed_iterations(tmp_path):
    """A killed run's directory: config.json, server_state.pt and log/, no summary.json."""
    from bdsgd.stages.engine.resume import Checkpointer

    run = tmp_path / "killed"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"policy": "static:3", "traces": "nowhere"}))
    log = {"policy": ["static:3"] * 7, "iteration": list(range(7)), "wall_s": [0.1] * 7,
           "iteration_s": [0.1] * 7, "c": [3] * 7, "workers": [4] * 7, "decision_ms": [0.0] * 7,
           "order": [[0, 1, 2]] * 7}  # fmt: skip
    Checkpointer(run).save({"version": 3, "run_id": "r", "next_iteration": 7, "log": log})
    result = CliRunner().invoke(cli, ["report", str(run), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "did not finish" in result.stderr and "7 iterations" in result.stderr
    index = (tmp_path / "r" / "index.md").read_text()
    assert "train run, 4 workers, 7 iterations" in index
