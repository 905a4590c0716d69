"""``bdsgd.stages.importer``: a foreign run-time log becomes schema-v1 rows, or nothing is written."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from bdsgd.stages.errors import ConfigError, TraceError
from bdsgd.stages.importer import ImportConfig, run_import
from bdsgd.stages.store import TraceStore

FOUR_ROWS = "iteration,worker,runtime_s\n0,0,1.0\n0,1,2.0\n1,0,1.5\n1,1,0.5\n"


def _write(tmp_path: Path, text: str, name: str = "log.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _import(tmp_path: Path, path: Path, **fields):
    return run_import(ImportConfig(path=path, traces=tmp_path / "traces", **fields))


def _rows(tmp_path: Path) -> pl.DataFrame:
    return TraceStore(tmp_path / "traces").read().sort("run_id", "iteration", "worker")


def test_four_rows_become_four_import_rows_with_defaults(tmp_path):
    result = _import(tmp_path, _write(tmp_path, FOUR_ROWS))
    df = _rows(tmp_path)
    assert result.rows == 4 and len(result.files) == 1
    assert len(result.runs) == 1 and result.runs[0].startswith("import-")
    assert df["source"].to_list() == ["import"] * 4
    assert df["policy"].to_list() == ["import"] * 4
    assert df["host"].to_list() == ["unknown"] * 4
    assert df["censored"].to_list() == [False] * 4
    assert df["cutoff"].null_count() == 4
    assert df["world_size"].to_list() == [2] * 4
    # start_s: cumulative sum of the worker's earlier run-times
    assert df["start_s"].to_list() == [0.0, 0.0, 1.0, 2.0]


def test_column_mapping_and_dense_worker_ranks(tmp_path):
    text = "step,node,secs,extra\n0,gpu-b,1.0,x\n0,gpu-a,2.0,y\n1,gpu-a,1.5,z\n1,gpu-b,0.5,w\n"
    _import(
        tmp_path,
        _write(tmp_path, text),
        iteration_col="step",
        worker_col="node",
        runtime_col="secs",
        run_id="mine",
    )
    df = _rows(tmp_path)
    assert len(df.columns) == 11 and "extra" not in df.columns
    assert df["run_id"].unique().to_list() == ["mine"]
    # gpu-a -> rank 0, gpu-b -> rank 1 (sorted order)
    assert df.select("iteration", "worker", "runtime_s").rows() == [
        (0, 0, 2.0),
        (0, 1, 1.0),
        (1, 0, 1.5),
        (1, 1, 0.5),
    ]


def test_sparse_integer_workers_map_to_dense_ranks_numerically(tmp_path):
    text = "iteration,worker,runtime_s\n0,10,1.0\n0,9,2.0\n0,100,3.0\n"
    _import(tmp_path, _write(tmp_path, text))
    df = _rows(tmp_path)
    assert df.select("worker", "runtime_s").rows() == [(0, 2.0), (1, 1.0), (2, 3.0)]
    assert df["world_size"].to_list() == [3] * 3


def test_optional_columns_are_used_by_schema_name_or_flag(tmp_path):
    text = (
        "run_id,iteration,worker,runtime_s,node,cut,start_s,world_size\n"
        "r1,0,0,1.0,n0,0,0.5,4\nr1,0,1,2.0,n1,1,0.5,4\nr2,0,0,3.0,n0,false,0.0,1\n"
    )
    result = _import(tmp_path, _write(tmp_path, text), host_col="node", censored_col="cut")
    df = _rows(tmp_path)
    assert result.runs == ["r1", "r2"]
    assert df["host"].to_list() == ["n0", "n1", "n0"]
    assert df["censored"].to_list() == [False, True, False]
    assert df["start_s"].to_list() == [0.5, 0.5, 0.0]
    assert df["world_size"].to_list() == [4, 4, 1]


def test_world_size_and_ranks_are_per_run(tmp_path):
    text = "run,iteration,worker,runtime_s\na,0,0,1\na,0,1,1\nb,0,7,1\n"
    _import(tmp_path, _write(tmp_path, text), run_col="run")
    df = _rows(tmp_path)
    assert df.select("run_id", "worker", "world_size").rows() == [
        ("a", 0, 2),
        ("a", 1, 2),
        ("b", 0, 1),
    ]


def test_parquet_input(tmp_path):
    path = tmp_path / "log.parquet"
    pl.read_csv(_write(tmp_path, FOUR_ROWS).open("rb")).write_parquet(path)
    assert _import(tmp_path, path).rows == 4


def _assert_nothing_written(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    assert not traces.exists() or not any(traces.iterdir())


@pytest.mark.parametrize(
    ("text", "fields", "message"),
    [
        ("a,b\n1,2,3\n", {}, "not a readable CSV file"),
        ("iteration,worker\n0,0\n", {}, "no column 'runtime_s'"),
        (FOUR_ROWS, {"worker_col": "rank"}, "no column 'rank'"),
        ("iteration,worker,runtime_s\n", {}, "no rows"),
        ("iteration,worker,runtime_s\n0,0,NaN\n0,1,1.0\n", {}, "runtime_s is not finite at row 0"),
        ("iteration,worker,t\n0,0,-2\n", {"runtime_col": "t"}, "runtime_s must be > 0.*'t'"),
        ("iteration,worker,runtime_s\n0,0,0\n", {}, "runtime_s must be > 0"),
        ("iteration,worker,runtime_s\n0,0,fast\n", {}, "'runtime_s' must hold numbers.* at row 0"),
        ("iteration,worker,runtime_s\n0,0,1\n0,0,2\n", {}, r"duplicate row.*\(rows 0 and 1\)"),
        ("iteration,worker,runtime_s\n0.5,0,1\n", {}, "'iteration' must hold whole .* at row 0"),
        (
            "iteration,worker,runtime_s\n0,0,1\n1e20,0,1\n",
            {},
            "whole numbers, got 1e\\+20 at row 1",
        ),
        ("iteration,worker,runtime_s\n-1,0,1\n", {}, "iteration must be >= 0, got -1 at row 0"),
        ("iteration,worker,runtime_s\n0,0,1\n1,0,\n", {}, "'runtime_s' is empty at row 1"),
        (
            "iteration,worker,runtime_s,world_size\n0,0,1,0\n",
            {},
            "world_size must be >= 1, got 0 at row 0",
        ),
        ("iteration,worker,runtime_s\n0,,1\n", {}, "'worker' is empty at row 0"),
        ("iteration,worker,runtime_s,censored\n0,0,1,maybe\n", {}, "'censored' must .* at row 0"),
    ],
)
def test_bad_logs_are_one_line_errors_and_write_nothing(tmp_path, text, fields, message):
    with pytest.raises(TraceError, match=message) as info:
        _import(tmp_path, _write(tmp_path, text), **fields)
    assert "\n" not in str(info.value)
    _assert_nothing_written(tmp_path)


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        _import(tmp_path, tmp_path / "absent.csv")
    _assert_nothing_written(tmp_path)


def test_importing_a_run_id_twice_is_refused(tmp_path):
    path = _write(tmp_path, FOUR_ROWS)
    _import(tmp_path, path, run_id="once")
    with pytest.raises(TraceError, match="already holds run 'once'"):
        _import(tmp_path, path, run_id="once")
    assert len(TraceStore(tmp_path / "traces").files()) == 1
    _import(tmp_path, path)  # a fresh id is fine
    assert _rows(tmp_path).height == 8


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"format": "xlsx"}, "format must be one of auto, csv, parquet, got 'xlsx'"),
        ({"worker_col": ""}, "--worker-col and --runtime-col must not be empty"),
        ({"worker_col": "x", "runtime_col": "x"}, "one input column mapped to two"),
        ({"run_id": "r", "run_col": "run"}, "cannot be combined with --run-col"),
        ({"run_id": " "}, "--run-id must be non-empty"),
    ],
)
def test_bad_configs(tmp_path, fields, needle):
    with pytest.raises(ConfigError, match=needle):
        ImportConfig(path=tmp_path / "x.csv", traces=tmp_path / "t", **fields)
