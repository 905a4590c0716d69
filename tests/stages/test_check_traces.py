"""A store the CLI can repair: a file bad only beside the others (a row another file holds, an
iteration far beyond its run's) or holding no row is named, ``--skip-bad-files`` leaves it out,
and ``check-traces --repair`` moves it into the quarantine folder (nothing deleted)."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bdsgd.schemas import SCHEMA
from bdsgd.stages.check_traces import QUARANTINE, CheckTracesConfig, check_traces
from bdsgd.stages.errors import TraceError
from bdsgd.stages.store import TraceStore
from click.testing import CliRunner

from bdsgd_cli.main import cli
from tests.conftest import make_trace_rows


def good_store(tmp_path) -> TraceStore:
    store = TraceStore(tmp_path / "traces")
    store.append(make_trace_rows(iterations=4, run_id="a"))
    store.append(make_trace_rows(iterations=4, run_id="b"))
    return store


def copied_file(store: TraceStore):
    first = store.files()[0]
    copy = store.path / f"part-99999999999999999999-{first.name[-16:]}"
    shutil.copy(first, copy)
    return copy


def far_iteration(store: TraceStore):
    rows = make_trace_rows(iterations=1, run_id="a")
    rows["iteration"] = [2**31 - 1] * len(rows["iteration"])
    return store.append(rows)


def zero_rows(store: TraceStore):
    path = store.path / "part-99999999999999999998-empty.parquet"
    pq.write_table(pa.Table.from_pylist([], schema=SCHEMA), path)
    return path


@pytest.mark.parametrize("damage", [copied_file, far_iteration, zero_rows])
def test_a_file_bad_beside_the_others_is_named_skipped_and_quarantined(tmp_path, damage):
    store = good_store(tmp_path)
    before = store.read().sort("run_id", "iteration", "worker")
    bad = damage(store)
    with pytest.raises(TraceError) as info:
        TraceStore(store.path, skip_bad_files=False).read()
    message = str(info.value)
    assert bad.name in message and "\n" not in message
    assert "--skip-bad-files" in message and f"check-traces {store.path} --repair" in message
    skipping = TraceStore(store.path, skip_bad_files=True)
    assert skipping.read().sort("run_id", "iteration", "worker").equals(before)
    assert skipping.skipped == [bad]

    result = check_traces(CheckTracesConfig(traces=store.path, repair=True))
    assert list(result.bad) == [bad] and result.moved == {bad: store.path / QUARANTINE / bad.name}
    assert (store.path / QUARANTINE / bad.name).is_file() and not bad.exists()
    assert TraceStore(store.path).read().sort("run_id", "iteration", "worker").equals(before)


def test_check_traces_cli_lists_then_repairs(tmp_path):
    store = good_store(tmp_path)
    bad = copied_file(store)
    listed = CliRunner().invoke(cli, ["check-traces", str(store.path), "--json"])
    assert listed.exit_code == 1, listed.output
    assert bad.name in listed.stderr and "--repair" in listed.stdout
    assert json.loads(listed.stdout.strip().splitlines()[-1])["bad"].keys() == {str(bad)}
    assert bad.exists()
    repaired = CliRunner().invoke(cli, ["check-traces", str(store.path), "--repair"])
    assert repaired.exit_code == 0, repaired.output
    assert f"1 moved to {store.path / QUARANTINE}" in repaired.stdout
    clean = CliRunner().invoke(cli, ["check-traces", str(store.path)])
    assert clean.exit_code == 0 and "2 of 2 files good (16 rows)" in clean.stdout


def test_a_quarantined_name_taken_already_is_not_overwritten(tmp_path):
    store = good_store(tmp_path)
    bad = copied_file(store)
    (store.path / QUARANTINE).mkdir()
    (store.path / QUARANTINE / bad.name).write_text("kept")
    with pytest.raises(TraceError, match="exists already"):
        check_traces(CheckTracesConfig(traces=store.path, repair=True))
    assert (store.path / QUARANTINE / bad.name).read_text() == "kept" and bad.exists()
