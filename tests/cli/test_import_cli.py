"""``bdsgd import``: the command's contract (summary, --json, one-line errors)."""

from __future__ import annotations

import json

import pytest
from bdsgd.stages.store import TraceStore
from click.testing import CliRunner

from bdsgd_cli.main import cli

FOUR_ROWS = "step,rank,secs\n0,0,1.0\n0,1,2.0\n1,0,1.5\n1,1,0.5\n"
MAPPING = ["--iteration-col", "step", "--worker-col", "rank", "--runtime-col", "secs"]


def _invoke(*args: str):
    return CliRunner().invoke(cli, ["import", *args])


def test_import_prints_json_and_writes_rows(tmp_path):
    log = tmp_path / "log.csv"
    log.write_text(FOUR_ROWS)
    traces = tmp_path / "traces"
    result = _invoke(str(log), "--traces", str(traces), *MAPPING, "--run-id", "r1", "--json")
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["rows"] == 4 and payload["runs"] == ["r1"]
    assert payload["traces"] == str(traces)
    assert [str(p) for p in TraceStore(traces).files()] == payload["files"]
    df = TraceStore(traces).read()
    assert df.height == 4 and set(df["source"]) == {"import"}


def test_import_prints_a_one_line_summary(tmp_path):
    log = tmp_path / "log.csv"
    log.write_text(FOUR_ROWS)
    result = _invoke(str(log), "--traces", str(tmp_path / "traces"), *MAPPING)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("imported 4 rows, 1 run(s)")


@pytest.mark.parametrize(
    ("text", "extra"),
    [
        ("step,rank,secs\n0,0,1\n0,1,2,3\n", []),  # malformed CSV
        ("step,secs\n0,1\n", []),  # missing mapped column
        ("step,rank,secs\n0,0,NaN\n0,1,1.0\n", []),  # NaN run-time
        (FOUR_ROWS, ["--format", "parquet"]),  # not Parquet
        (None, []),  # missing file
        ("step,rank,secs\n1000000000000,0,1.0\n", []),  # iteration beyond 2^31 - 1
        ("step,rank,secs,n\n0,0,1.0,2147483647\n", ["--world-size-col", "n"]),  # 2^31 - 1
    ],
)
def test_errors_are_one_line_on_stderr_and_write_nothing(tmp_path, text, extra):
    log = tmp_path / "log.csv"
    if text is not None:
        log.write_text(text)
    traces = tmp_path / "traces"
    result = _invoke(str(log), "--traces", str(traces), *MAPPING, *extra)
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert result.stdout == ""
    assert not traces.exists() or not any(traces.iterdir())
