"""``bdsgd profile`` end to end: real worker processes, schema-v1 rows appended per run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bdsgd.stages.store import TraceStore

BDSGD = str(Path(sys.executable).with_name("bdsgd"))

SCHEMA_V1 = {
    "run_id": pa.string(),
    "iteration": pa.int64(),
    "worker": pa.int32(),
    "host": pa.string(),
    "world_size": pa.int32(),
    "start_s": pa.float64(),
    "runtime_s": pa.float64(),
    "censored": pa.bool_(),
    "cutoff": pa.int32(),
    "policy": pa.string(),
    "source": pa.string(),
}


def bdsgd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BDSGD, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def two_profiles(tmp_path_factory):
    traces = tmp_path_factory.mktemp("profile") / "traces"
    args = ("profile", "--workers", "4", "--iterations", "20", "--traces", str(traces))
    args += ("--stragglers", "synthetic:base_s=0.002", "--batch-size", "16")
    for _ in range(2):
        done = bdsgd(*args)
        assert done.returncode == 0, done.stderr
    return traces


def test_two_runs_append_160_rows(two_profiles):
    df = TraceStore(two_profiles).read()
    assert df.height == 160
    assert df["run_id"].n_unique() == 2
    for _, run in df.group_by("run_id"):
        assert sorted(set(zip(run["iteration"], run["worker"], strict=True))) == [
            (t, w) for t in range(20) for w in range(4)
        ]


def test_files_carry_the_eleven_columns_typed_as_schema_v1(two_profiles):
    files = TraceStore(two_profiles).files()
    assert files
    for f in files:
        schema = pq.read_schema(f)
        for name, dtype in SCHEMA_V1.items():
            assert schema.field(name).type == dtype, name
        assert schema.field("cutoff").nullable


def test_profile_values(two_profiles):
    df = TraceStore(two_profiles).read()
    assert (df["runtime_s"] > 0).all()
    assert df["source"].unique().to_list() == ["profile"]
    assert df["policy"].unique().to_list() == ["full"]
    assert not df["censored"].any()
    assert df["cutoff"].null_count() == df.height
    assert df["world_size"].unique().to_list() == [4]


@pytest.mark.parametrize(
    "args",
    [
        ("--workers", "0", "--iterations", "5"),
        ("--workers", "2", "--iterations", "0"),
        ("--workers", "2", "--iterations", "5", "--stragglers", "bogus"),
        ("--workers", "10000", "--iterations", "5"),  # more than this machine runs
        ("--workers", "2", "--iterations", "5", "--timeout", "nan"),
        ("--workers", "2", "--iterations", "5", "--timeout", "inf"),
        ("--workers", "2", "--iterations", "5", "--time-scale", "nan"),
        ("--workers", "2", "--iterations", "5", "--stragglers", "synthetic:base_s=inf"),
    ],
)
def test_bad_input_is_one_line_on_stderr(tmp_path, args):
    done = bdsgd("profile", "--traces", str(tmp_path / "t"), *args, timeout=60)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert "Traceback" not in done.stderr
    assert not TraceStore(tmp_path / "t").files()
