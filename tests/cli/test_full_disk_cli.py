"""``fit --checkpoint`` and ``report --out`` on a full disk: one line, exit 2, and nothing
half-written left there (an earlier checkpoint stays as it was)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from bdsgd_cli.main import cli
from tests.cli.test_fit_cli import FAST
from tests.cli.test_report_cli import _run_dir
from tests.full_disk import Disk
from tests.stages.model.clusters import tiny_store


@pytest.fixture
def disk(tmp_path, monkeypatch):
    d = Disk(tmp_path / "disk", monkeypatch)
    yield d
    d.unmount()


def one_line_no_space(result) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: cannot write")
    assert "No space left on device" in result.stderr and "Traceback" not in result.output


def test_fit_on_a_full_disk_is_one_line_and_keeps_the_earlier_checkpoint(tmp_path, disk):
    store = tiny_store(tmp_path / "traces")
    ckpt = disk.path / "model.pt"
    args = ["fit", "--traces", str(store.path), "--checkpoint", str(ckpt), *FAST]
    assert CliRunner().invoke(cli, args).exit_code == 0
    before = ckpt.read_bytes()
    disk.fill()
    one_line_no_space(CliRunner().invoke(cli, args))
    assert ckpt.read_bytes() == before
    assert sorted(p.name for p in disk.path.iterdir()) in (["model.pt"], ["filler", "model.pt"])


def test_report_on_a_full_disk_is_one_line(tmp_path, disk):
    run = _run_dir(tmp_path / "run")
    disk.fill()
    one_line_no_space(CliRunner().invoke(cli, ["report", str(run), "--out", str(disk.path / "r")]))
    assert not list((disk.path / "r").glob(".tmp-*"))
