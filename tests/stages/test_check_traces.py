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


def rows_of(run_id: str, iterations: range, workers: int = 3, scale: float = 1.0) -> dict:
    """Schema-v1 rows of ``run_id`` at ``iterations`` (a resumed run re-measures: ``scale``)."""
    cells = [(t, w) for t in iterations for w in range(workers)]
    return {
        "run_id": [run_id] * len(cells), "iteration": [t for t, _ in cells],
        "worker": [w for _, w in cells], "host": [f"h{w}" for _, w in cells],
        "world_size": [workers] * len(cells), "start_s": [t * 2.0 * scale for t, _ in cells],
        "runtime_s": [scale * (1 + w) for _, w in cells], "censored": [False] * len(cells),
        "cutoff": [None] * len(cells), "policy": ["full"] * len(cells),
        "source": ["train"] * len(cells),
    }  # fmt: skip


def write_run(store: TraceStore, run_id: str, first: int, last: int, every: int = 10, **kw):
    """Append ``run_id``'s iterations first..last as a trainer does: a file per ``every``."""
    ends = [*range(first - first % every + every, last + 1, every), last + 1]
    starts = [first, *ends[:-1]]
    return [
        store.append(rows_of(run_id, range(a, b), **kw)) for a, b in zip(starts, ends, strict=True)
    ]


def snapshot(store: TraceStore) -> dict[str, bytes]:
    """Every trace file's bytes by name, quarantined ones included."""
    return {p.name: p.read_bytes() for p in store.path.rglob("part-*.parquet")}


def cells(store: TraceStore) -> list[tuple[str, int, int]]:
    df = TraceStore(store.path).read().sort("iteration", "worker")
    return list(df.select("run_id", "iteration", "worker").iter_rows())


def assert_nothing_deleted(store: TraceStore, before: dict[str, bytes]) -> None:
    after = snapshot(store)
    assert {name: after.get(name) for name in before} == before


def test_a_resumed_run_under_a_second_run_id_is_named_and_its_copy_quarantined(tmp_path):
    store = TraceStore(tmp_path / "traces")
    first_run = write_run(store, "a", 0, 34)  # killed after iteration 34, checkpoint at 30
    resumed = write_run(store, "b", 30, 59, scale=1.1)  # resumed at 30 under a new run id
    before = snapshot(store)

    result = check_traces(CheckTracesConfig(traces=store.path))
    assert list(result.bad) == [resumed[0]] and result.problem_counts()["other_run"] == 1
    why = result.bad[resumed[0]]
    assert first_run[-1].name in why and resumed[0].name in why
    assert "iterations 30-34 of run 'b'" in why and "run 'a'" in why and "\n" not in why
    assert result.moved == {} and snapshot(store) == before

    repaired = check_traces(CheckTracesConfig(traces=store.path, repair=True))
    quarantined = store.path / QUARANTINE / resumed[0].name
    assert repaired.moved == {resumed[0]: quarantined} and quarantined.is_file()
    assert_nothing_deleted(store, before)
    expected = [("a" if t < 35 else "b", t, w) for t in range(60) for w in range(3)]
    assert cells(store) == expected  # every iteration once: 35-39 stay, under b
    assert check_traces(CheckTracesConfig(traces=store.path)).bad == {}


def test_each_resume_of_a_chain_is_checked_against_the_run_it_continues(tmp_path):
    store = TraceStore(tmp_path / "traces")
    write_run(store, "a", 0, 34)
    second = write_run(store, "b", 30, 64, scale=1.1)
    third = write_run(store, "c", 60, 79, scale=1.2)
    result = check_traces(CheckTracesConfig(traces=store.path))
    assert list(result.bad) == [second[0], third[0]]
    assert [(c.run_id, c.of_run_id, c.first_iteration, c.last_iteration) for c in result.copies] \
        == [("b", "a", 30, 34), ("c", "b", 60, 64)]  # fmt: skip
    check_traces(CheckTracesConfig(traces=store.path, repair=True))
    assert [t for _, t, w in cells(store) if w == 0] == list(range(80))


def test_the_same_rows_of_one_run_in_two_files_name_both_and_keep_the_rest(tmp_path):
    store = TraceStore(tmp_path / "traces")
    earlier = write_run(store, "a", 0, 19)
    again = store.append(rows_of("a", range(15, 25)))  # 15-19 twice, 20-24 only here
    before = snapshot(store)
    result = check_traces(CheckTracesConfig(traces=store.path))
    assert list(result.bad) == [again] and result.problem_counts()["same_run"] == 1
    assert (
        earlier[1].name in result.bad[again] and "15 row(s) (iterations 15-19" in result.bad[again]
    )
    repaired = check_traces(CheckTracesConfig(traces=store.path, repair=True))
    assert repaired.moved == {again: store.path / QUARANTINE / again.name}
    rest = repaired.kept[again]
    assert rest.parent == store.path and store.files()[-1] == rest  # sorts where `again` did
    assert_nothing_deleted(store, before)
    assert cells(store) == [("a", t, w) for t in range(25) for w in range(3)]


def test_runs_that_are_not_one_job_are_left_alone(tmp_path):
    store = TraceStore(tmp_path / "traces")
    write_run(store, "a", 0, 34)
    write_run(store, "b", 0, 34)  # a second fresh run, the same rows
    write_run(store, "c", 30, 39, workers=2)  # another world size
    write_run(store, "d", 40, 49)  # begins after every run it could continue ends
    result = check_traces(CheckTracesConfig(traces=store.path))
    assert result.bad == {} and result.copies == []


def test_check_traces_cli_counts_the_problems_and_repairs_a_resumed_copy(tmp_path):
    store = TraceStore(tmp_path / "traces")
    write_run(store, "a", 0, 34)
    resumed = write_run(store, "b", 30, 39, scale=1.1)
    listed = CliRunner().invoke(cli, ["check-traces", str(store.path), "--json"])
    assert listed.exit_code == 1, listed.output
    assert "4 of 5 files good (105 rows)" in listed.stdout
    assert "1 problem(s): 1 repeating iterations of another run id" in listed.stdout
    summary = json.loads(listed.stdout.strip().splitlines()[-1])
    assert summary["problems"] == 1 and summary["copies"][0]["iterations"] == [30, 34]
    assert resumed[0].name in listed.stderr
    repaired = CliRunner().invoke(cli, ["check-traces", str(store.path), "--repair"])
    assert repaired.exit_code == 0, repaired.output
    assert f"1 moved to {store.path / QUARANTINE}" in repaired.stdout
    assert "other rows stay in" in repaired.stderr
    clean = CliRunner().invoke(cli, ["check-traces", str(store.path)])
    assert clean.exit_code == 0 and "5 of 5 files good (120 rows); no problems" in clean.stdout


def test_a_clean_store_says_every_file_is_good(tmp_path):
    store = good_store(tmp_path)
    clean = CliRunner().invoke(cli, ["check-traces", str(store.path)])
    assert clean.exit_code == 0 and "2 of 2 files good (16 rows); no problems" in clean.stdout
