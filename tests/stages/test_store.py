"""The trace store: atomic appends, readers that see only complete files, run matrices."""

from __future__ import annotations

import tracemalloc

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bdsgd.schemas import to_table
from bdsgd.stages import store as store_module
from bdsgd.stages.errors import TraceError
from bdsgd.stages.store import (
    TraceStore,
    TraceWriter,
    new_run_id,
    read_trace_path,
    to_run_matrix,
)


@pytest.fixture
def store(tmp_path) -> TraceStore:
    return TraceStore(tmp_path / "traces")


def test_append_and_read_round_trip(store, trace_rows):
    rows = trace_rows(iterations=3, workers=2)
    path = store.append(rows)
    assert path.name.startswith("part-") and path.suffix == ".parquet"
    df = store.read().sort("iteration", "worker")
    assert df.height == 6
    assert df["runtime_s"].to_list() == rows["runtime_s"]
    assert df["host"].to_list() == rows["host"]
    assert df["cutoff"].null_count() == 6


def test_two_appends_make_two_files(store, trace_rows):
    store.append(trace_rows(run_id="a"))
    store.append(trace_rows(run_id="b"))
    assert len(store.files()) == 2
    runs = store.runs()
    assert runs["run_id"].to_list() == ["a", "b"]
    assert runs["rows"].to_list() == [4, 4]


def test_extra_columns_survive_whatever_file_comes_first(store, trace_rows):
    store.append(trace_rows(run_id="a"))
    store.append({**trace_rows(run_id="b"), "injected_delay_s": [0.5] * 4})
    df = store.read().sort("run_id")
    assert df["injected_delay_s"].to_list() == [None] * 4 + [0.5] * 4


def test_crash_between_write_and_rename_leaves_no_trace(store, trace_rows, monkeypatch):
    first = store.append(trace_rows(run_id="a"))
    before = first.read_bytes()

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module.os, "replace", crash)
    with pytest.raises(TraceError, match="cannot write to trace store"):
        store.append(trace_rows(run_id="b"))
    monkeypatch.undo()
    assert sorted(p.name for p in store.path.iterdir()) == [first.name]
    assert first.read_bytes() == before
    assert store.read()["run_id"].unique().to_list() == ["a"]


def test_leftover_temp_file_is_ignored(store, trace_rows):
    store.append(trace_rows(run_id="a"))
    (store.path / ".tmp-part-1-half.parquet").write_bytes(b"PAR1 half written")
    assert len(store.files()) == 1
    assert store.read().height == 4


@pytest.mark.parametrize("cut", ["truncated", "garbage"])
def test_corrupt_part_file_is_a_one_line_error_naming_it(store, trace_rows, cut):
    good = store.append(trace_rows(run_id="a"))
    data = good.read_bytes()
    bad = store.path / "part-99999999999999999999-bad.parquet"
    bad.write_bytes(data[: len(data) // 2] if cut == "truncated" else b"not parquet at all")
    with pytest.raises(TraceError) as info:
        store.read()
    message = str(info.value)
    assert bad.name in message and "\n" not in message


def test_empty_store_is_an_error(store):
    with pytest.raises(TraceError, match="holds no trace files"):
        store.read()
    store.path.mkdir()
    with pytest.raises(TraceError, match="holds no trace files"):
        store.read()


def test_invalid_rows_are_refused_before_anything_is_written(store, trace_rows):
    rows = trace_rows()
    rows["runtime_s"][0] = float("nan")
    with pytest.raises(TraceError, match="runtime_s is not finite"):
        store.append(rows)
    assert store.files() == []


def test_run_matrix_shapes_and_masks_with_a_missing_row(store, trace_rows):
    rows = trace_rows(iterations=3, workers=2)
    rows["censored"][3] = True  # iteration 1, worker 1
    keep = [i for i in range(6) if i != 4]  # drop iteration 2, worker 0
    store.append({k: [v[i] for i in keep] for k, v in rows.items()})
    store.append(trace_rows(iterations=2, workers=3, run_id="run-b"))
    run = store.run_matrix("run-a")
    assert run.shape == (3, 2)
    assert run.present.tolist() == [[True, True], [True, True], [False, True]]
    assert run.censored.tolist() == [[False, False], [False, True], [False, False]]
    assert np.isnan(run.runtimes[2, 0]) and run.runtimes[2, 1] == 2.0
    assert run.hosts == ("h0", "h1")
    assert [m.shape for m in store.run_matrices()] == [(3, 2), (2, 3)]
    with pytest.raises(TraceError, match="no run 'nope'"):
        store.run_matrix("nope")


def test_read_trace_path_reads_a_single_file_or_a_directory(store, trace_rows, tmp_path):
    path = store.append(trace_rows())
    assert read_trace_path(path).height == 4
    assert read_trace_path(store.path).height == 4
    with pytest.raises(TraceError, match="no trace at"):
        read_trace_path(tmp_path / "missing.parquet")


def _one_iteration(t: int, workers: int = 2) -> dict[str, list]:
    return {
        "run_id": ["w"] * workers,
        "iteration": [t] * workers,
        "worker": list(range(workers)),
        "host": ["h"] * workers,
        "world_size": [workers] * workers,
        "start_s": [0.0] * workers,
        "runtime_s": [1.0] * workers,
        "censored": [False] * workers,
        "cutoff": [1] * workers,
        "policy": ["static:1"] * workers,
        "source": ["train"] * workers,
    }


def test_trace_writer_batches_and_close_flushes(store):
    writer = TraceWriter(store, batch_rows=4)
    for t in range(5):
        writer.add(_one_iteration(t))
    writer.close()
    assert writer.rows_written == 10
    assert len(writer.files) == 3  # 4 + 4 rows in batches, 2 flushed by close
    assert sorted(store.read()["iteration"].unique().to_list()) == [0, 1, 2, 3, 4]


def test_trace_writer_reports_a_failed_batch(store):
    writer = TraceWriter(store, batch_rows=100)
    bad = _one_iteration(0)
    bad["runtime_s"] = [-1.0, 1.0]
    writer.add(bad)
    with pytest.raises(TraceError, match="writing traces failed"):
        writer.close()
    assert store.files() == []


def test_unwritable_directory_is_an_error(tmp_path, trace_rows):
    """A store under a file cannot be created, whoever runs the test (root included)."""
    (tmp_path / "file").write_text("not a directory")
    store = TraceStore(tmp_path / "file" / "traces")
    with pytest.raises(TraceError, match="cannot create trace store .*file/traces"):
        store.check_writable()
    with pytest.raises(TraceError, match="cannot create trace store .*file/traces"):
        store.append(trace_rows())
    assert (tmp_path / "file").read_text() == "not a directory"


def test_new_run_id_is_unique_and_prefixed():
    ids = {new_run_id("import") for _ in range(20)}
    assert len(ids) == 20 and all(i.startswith("import-") for i in ids)


def test_appended_table_keeps_schema_metadata(store, trace_rows):
    path = store.append(to_table(trace_rows()))
    assert pq.read_schema(path).metadata[b"bdsgd.trace_schema"] == b"1"
    assert pq.read_schema(path).field("worker").type == pa.int32()


def test_matrix_rows_round_trips_through_the_store(tmp_path):
    from bdsgd.stages.store import RunMatrix, matrix_rows

    runtimes = np.array([[1.0, 2.0, 3.0], [1.5, 2.5, 3.5]])
    censored = np.array([[False, False, True], [False, True, False]])
    present = np.array([[True, True, True], [True, True, False]])  # worker 2 died
    run = RunMatrix("r", runtimes, censored, present, ("a", "a", "b"))
    store = TraceStore(tmp_path / "t")
    store.append(matrix_rows(run, policy="static:2", source="train"))
    back = store.run_matrix("r")
    np.testing.assert_array_equal(back.present, present)
    np.testing.assert_array_equal(back.runtimes[present], runtimes[present])
    np.testing.assert_array_equal(back.censored[present], censored[present])
    assert back.hosts == ("a", "a", "b")


# -- a bad file among good ones ---------------------------------------------------------------
def write_unchecked(store: TraceStore, rows: dict, name: str) -> bytes:
    """A file another tool wrote without our checks; returns its bytes."""
    store.path.mkdir(parents=True, exist_ok=True)
    pq.write_table(to_table(rows), store.path / name)
    return (store.path / name).read_bytes()


@pytest.fixture
def store_with_bad_files(tmp_path, trace_rows):
    """Two good runs, a file that is not Parquet and a file whose iterations are out of range."""
    good = TraceStore(tmp_path / "traces")
    good.append(trace_rows(run_id="a"))
    good.append(trace_rows(run_id="b"))
    bad = {"part-zz-garbage.parquet": b"not parquet at all"}
    (good.path / "part-zz-garbage.parquet").write_bytes(bad["part-zz-garbage.parquet"])
    rows = trace_rows(run_id="c")
    rows["iteration"] = [10**12] * len(rows["iteration"])
    bad["part-zz-huge.parquet"] = write_unchecked(good, rows, "part-zz-huge.parquet")
    return good.path, bad


@pytest.mark.parametrize("skip", [None, False])
def test_a_bad_file_is_named_and_refused(store_with_bad_files, skip):
    path, bad = store_with_bad_files
    with pytest.raises(TraceError, match="part-zz-garbage.parquet: not a readable Parquet") as err:
        TraceStore(path, skip_bad_files=skip).read()
    assert ("--skip-bad-files" in str(err.value)) == (skip is False)
    for name, content in bad.items():
        assert (path / name).read_bytes() == content  # never modified


def test_skip_bad_files_reads_the_good_ones(store_with_bad_files):
    path, bad = store_with_bad_files
    store = TraceStore(path, skip_bad_files=True)
    df = store.read()
    assert sorted(df["run_id"].unique().to_list()) == ["a", "b"]
    assert sorted(p.name for p in store.skipped) == sorted(bad)
    assert [r.run_id for r in store.run_matrices()] == ["a", "b"]
    assert store.run_matrix("b").shape == (2, 2)
    for name, content in bad.items():
        assert (path / name).read_bytes() == content


def test_the_latest_run_is_the_one_that_wrote_the_newest_file(tmp_path, trace_rows):
    """Not the id that sorts last: a train run written after a profile is the latest."""
    store = TraceStore(tmp_path / "traces")
    store.append(trace_rows(run_id="profile-2"))
    store.append(trace_rows(run_id="import-1"))
    assert store.latest_run_id() == "import-1"
    store.append(trace_rows(run_id="b"))
    assert store.latest_run_id() == "b"


def test_a_bad_newest_file_is_refused_or_skipped_for_the_latest_run(store_with_bad_files):
    path, _ = store_with_bad_files  # the bad files' names sort after the good ones
    with pytest.raises(TraceError, match="part-zz-huge.parquet"):
        TraceStore(path).latest_run_id()
    assert TraceStore(path, skip_bad_files=True).latest_run_id() == "b"


def test_an_out_of_range_file_is_named(tmp_path, trace_rows):
    store = TraceStore(tmp_path / "traces", skip_bad_files=False)
    store.append(trace_rows(run_id="a"))
    rows = trace_rows(run_id="c")
    rows["world_size"] = [2**31 - 1] * len(rows["world_size"])
    write_unchecked(store, rows, "part-zz-wide.parquet")
    with pytest.raises(TraceError, match=r"part-zz-wide.parquet: world_size 2147483647 is above"):
        store.run_matrices()
    with pytest.raises(TraceError, match="part-zz-wide.parquet"):
        store.run_matrix("c")


def test_a_run_matrix_is_never_sized_by_a_stray_value(trace_rows):
    """Iteration 2^31 - 1 is in range, but four rows cannot make a 2^31 x 2 matrix: refused
    before anything is allocated."""
    rows = trace_rows(iterations=2, workers=2)
    rows["iteration"] = [0, 0, 2**31 - 1, 2**31 - 1]
    df = pl.from_arrow(to_table(rows))
    tracemalloc.start()
    try:
        with pytest.raises(TraceError, match=r"4 rows spread over iterations up to 2147483647"):
            to_run_matrix(df)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_sparse_but_small_run_is_still_read(trace_rows):
    rows = trace_rows(iterations=2, workers=2)
    rows["iteration"] = [0, 0, 5000, 5000]  # a gap: rows lost in a crash, say
    run = to_run_matrix(pl.from_arrow(to_table(rows)))
    assert run.shape == (5001, 2) and run.present.sum() == 4


def test_check_writable_undoes_only_the_empty_directories_it_made(tmp_path, trace_rows):
    """A run that fails before its first row leaves no empty trace store; one with rows (or a
    store that was there) stays."""
    undo = TraceStore(tmp_path / "new" / "traces").check_writable()
    assert (tmp_path / "new" / "traces").is_dir()
    undo()
    assert not (tmp_path / "new").exists()
    store = TraceStore(tmp_path / "kept")
    undo = store.check_writable()
    store.append(trace_rows(run_id="a"))
    undo()
    assert store.read().height > 0
    assert TraceStore(tmp_path).check_writable()() is None and tmp_path.is_dir()
