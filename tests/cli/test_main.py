"""The ``bdsgd`` group: a usage error is one line like every other error."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from bdsgd_cli.main import cli


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["train", "--bogus"], "No such option '--bogus'"),
        (["train", "--workers", "x"], "Invalid value for '--workers'"),
        (["report", "--out", "somewhere"], "Missing argument 'RUN_DIR...'"),
        (["nosuch"], "No such command 'nosuch'"),
    ],
)
def test_a_usage_error_is_one_line_naming_the_help(args, needle):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert "--help)" in lines[0]


def test_help_and_version_still_exit_zero():
    assert CliRunner().invoke(cli, ["train", "--help"]).exit_code == 0
    version = CliRunner().invoke(cli, ["--version"])
    assert version.exit_code == 0 and "version" in version.stdout
