"""Trace schema v1 as code: every validator rule fails on a bad table and names what is wrong."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bdsgd.schemas import COLUMNS, VERSION_KEY, to_table, validate_schema, validate_table
from bdsgd.schemas.trace_v1 import MAX_ITERATION, MAX_WORLD_SIZE
from bdsgd.stages.errors import TraceError
from bdsgd.stages.store import TraceStore


def _table(trace_rows, **changes) -> pa.Table:
    rows = trace_rows()
    rows.update(changes)
    return to_table(rows)


def _replace_column(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    idx = table.schema.get_field_index(name)
    return table.set_column(idx, pa.field(name, array.type), array)


def test_valid_table_passes_and_carries_version(trace_rows):
    table = _table(trace_rows)
    validate_table(table)
    assert table.schema.metadata[VERSION_KEY] == b"1"
    assert [f.name for f in table.schema][:11] == [f.name for f in COLUMNS]


# the SPEC's table, written out here rather than taken from SCHEMA, as another tool would
SPEC_COLUMNS = [
    ("run_id", pa.string()),
    ("iteration", pa.int64()),
    ("worker", pa.int32()),
    ("host", pa.string()),
    ("world_size", pa.int32()),
    ("start_s", pa.float64()),
    ("runtime_s", pa.float64()),
    ("censored", pa.bool_()),
    ("cutoff", pa.int32()),
    ("policy", pa.string()),
    ("source", pa.string()),
]


def test_a_file_of_only_the_eleven_columns_is_read(tmp_path, trace_rows):
    """Readers must accept traces another tool wrote with the SPEC's eleven columns and nothing
    else (no version metadata, none of our extra columns)."""
    assert [(f.name, f.type) for f in COLUMNS] == SPEC_COLUMNS
    table = pa.Table.from_pydict(trace_rows(), schema=pa.schema(SPEC_COLUMNS))
    validate_table(table)
    store = TraceStore(tmp_path / "store")
    store.path.mkdir()
    pq.write_table(table, store.path / "part-other-tool.parquet")
    rows = store.read()
    assert rows.columns == [name for name, _ in SPEC_COLUMNS]
    assert rows.height == table.num_rows
    assert rows["runtime_s"].to_list() == trace_rows()["runtime_s"]


def test_extra_columns_are_accepted_and_kept(trace_rows):
    table = _table(trace_rows, injected_delay_s=[0.1, 0.0, 0.2, 0.0], workload=["mlp"] * 4)
    validate_table(table)
    assert table.column_names[-2:] == ["injected_delay_s", "workload"]


def test_missing_column_is_named(trace_rows):
    table = _table(trace_rows).drop_columns(["host"])
    with pytest.raises(TraceError, match="missing column 'host'"):
        validate_table(table)


def test_to_table_names_missing_columns(trace_rows):
    rows = trace_rows()
    del rows["censored"]
    with pytest.raises(TraceError, match="censored"):
        to_table(rows)


def test_mistyped_column_is_named(trace_rows):
    table = _table(trace_rows)
    table = _replace_column(table, "worker", pa.array([0, 1, 0, 1], pa.int64()))
    with pytest.raises(TraceError, match="'worker' has type int64, expected int32"):
        validate_table(table)


def test_unconvertible_value_is_named_by_to_table(trace_rows):
    with pytest.raises(TraceError, match="'runtime_s'"):
        _table(trace_rows, runtime_s=["fast", 1.0, 1.0, 1.0])


def test_wrong_version_metadata(trace_rows):
    table = _table(trace_rows)
    table = table.replace_schema_metadata({VERSION_KEY: b"2"})
    with pytest.raises(TraceError, match="version '2', expected '1'"):
        validate_schema(table.schema)


def test_large_string_is_accepted_as_string(trace_rows):
    table = _table(trace_rows)
    table = _replace_column(table, "run_id", table["run_id"].cast(pa.large_string()).chunk(0))
    validate_table(table)


@pytest.mark.parametrize(
    ("runtime", "message"),
    [
        (float("nan"), "runtime_s is not finite at row 1"),
        (float("inf"), "runtime_s is not finite at row 1"),
        (-0.5, "runtime_s must be > 0, got -0.5 at row 1"),
        (0.0, "runtime_s must be > 0, got 0.0 at row 1"),
    ],
)
def test_bad_runtimes(trace_rows, runtime, message):
    table = _table(trace_rows, runtime_s=[1.0, runtime, 1.0, 1.0])
    with pytest.raises(TraceError, match=message):
        validate_table(table)


def test_negative_start_time(trace_rows):
    with pytest.raises(TraceError, match="start_s must be >= 0"):
        validate_table(_table(trace_rows, start_s=[0.0, -1.0, 0.0, 0.0]))


@pytest.mark.parametrize("worker", [2, -1])
def test_worker_outside_world(trace_rows, worker):
    table = _table(trace_rows, worker=[0, worker, 0, 1])
    with pytest.raises(TraceError, match=f"worker {worker} outside 0..1 at row 1"):
        validate_table(table)


def test_duplicate_run_iteration_worker(trace_rows):
    table = _table(trace_rows, worker=[0, 1, 1, 1])
    with pytest.raises(TraceError, match="duplicate row for run_id='run-a' iteration=1 worker=1"):
        validate_table(table)


def test_same_cell_in_two_runs_is_not_a_duplicate(trace_rows):
    rows = trace_rows()
    other = trace_rows(run_id="run-b")
    table = to_table({k: rows[k] + other[k] for k in rows})
    validate_table(table)


def test_null_in_non_nullable_column(trace_rows):
    with pytest.raises(TraceError, match="column 'host' has 1 null"):
        validate_table(_table(trace_rows, host=["h0", None, "h0", "h1"]))


def test_null_cutoff_is_allowed_and_set_cutoff_kept(trace_rows):
    table = _table(trace_rows, cutoff=[None, None, 1, 1])
    validate_table(table)
    assert table["cutoff"].to_pylist() == [None, None, 1, 1]


def test_empty_table(trace_rows):
    rows = {k: [] for k in trace_rows()}
    with pytest.raises(TraceError, match="no rows"):
        validate_table(to_table(rows))


@pytest.mark.parametrize(
    ("column", "value", "needle"),
    [
        ("iteration", MAX_ITERATION + 1, f"iteration {MAX_ITERATION + 1} is above"),
        ("iteration", 10**12, "iteration 1000000000000 is above"),
        ("world_size", MAX_WORLD_SIZE + 1, f"world_size {MAX_WORLD_SIZE + 1} is above"),
        ("world_size", 2**31 - 1, "world_size 2147483647 is above"),
    ],
)
def test_values_beyond_the_ranges_are_refused(trace_rows, column, value, needle):
    rows = trace_rows()
    rows[column] = [value] * len(rows[column])
    with pytest.raises(TraceError, match=needle):
        validate_table(to_table(rows))


def test_the_largest_values_in_range_are_accepted(trace_rows):
    rows = trace_rows(iterations=1, workers=2)
    rows["iteration"] = [MAX_ITERATION] * 2
    rows["world_size"] = [MAX_WORLD_SIZE] * 2
    validate_table(to_table(rows))
