"""Trace schema v1: one row per (run, iteration, worker).

The schema is a contract shared with other tools (see SPEC.md): eleven required columns with exact
Arrow types, the version in the Arrow schema metadata under ``bdsgd.trace_schema``. Extra columns
are allowed and kept. Every writer builds its table with :func:`to_table`; every reader checks a
file with :func:`validate_schema` and its rows with :func:`validate_table`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc
from bdsgd.stages.errors import TraceError

SCHEMA_VERSION = "1"
VERSION_KEY = b"bdsgd.trace_schema"

COLUMNS: tuple[pa.Field, ...] = (
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("iteration", pa.int64(), nullable=False),
    pa.field("worker", pa.int32(), nullable=False),
    pa.field("host", pa.string(), nullable=False),
    pa.field("world_size", pa.int32(), nullable=False),
    pa.field("start_s", pa.float64(), nullable=False),
    pa.field("runtime_s", pa.float64(), nullable=False),
    pa.field("censored", pa.bool_(), nullable=False),
    pa.field("cutoff", pa.int32(), nullable=True),
    pa.field("policy", pa.string(), nullable=False),
    pa.field("source", pa.string(), nullable=False),
)
REQUIRED = tuple(f.name for f in COLUMNS)
SCHEMA = pa.schema(COLUMNS, metadata={VERSION_KEY: SCHEMA_VERSION.encode()})
SOURCES = ("profile", "train", "import")
MAX_ITERATION = 2**31 - 1
"""Largest iteration a trace may hold (at one iteration a millisecond, 24 days of them): a value
beyond is taken for corruption, not for a run, so no reader sizes anything by it."""
MAX_WORLD_SIZE = 2**20
"""Largest world size a trace may declare (a million workers)."""


def to_table(columns: Mapping[str, Sequence | pa.Array]) -> pa.Table:
    """Build a schema-v1 table from column data; extra columns (e.g. ``injected_delay_s``) follow."""
    missing = [name for name in REQUIRED if name not in columns]
    if missing:
        raise TraceError(f"trace rows lack column(s): {', '.join(missing)}")
    arrays, fields = [], list(COLUMNS)
    for f in COLUMNS:
        arrays.append(_typed_array(columns[f.name], f))
    for name, values in columns.items():
        if name not in REQUIRED:
            arr = values if isinstance(values, pa.Array) else pa.array(values)
            arrays.append(arr)
            fields.append(pa.field(name, arr.type))
    schema = pa.schema(fields, metadata={VERSION_KEY: SCHEMA_VERSION.encode()})
    return pa.Table.from_arrays(arrays, schema=schema)


def _typed_array(values: Sequence | pa.Array, f: pa.Field) -> pa.Array:
    """One column converted to its schema type; a value that does not convert names the column."""
    try:
        if isinstance(values, pa.Array | pa.ChunkedArray):
            return values.cast(f.type)
        return pa.array(values, type=f.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(f"column {f.name!r} cannot be {f.type}: {detail}") from None


# Arrow types a reader accepts for a schema type: polars writes text as large_string.
_EQUIVALENT = {pa.string(): (pa.string(), pa.large_string())}


def validate_schema(schema: pa.Schema, where: str = "trace") -> None:
    """Check version metadata and the eleven columns' presence and types; name what is wrong.

    A file without the version key is read as v1 (tools such as polars drop schema metadata), and
    ``large_string`` is accepted where the schema says ``string``."""
    version = (schema.metadata or {}).get(VERSION_KEY)
    if version is not None and version.decode() != SCHEMA_VERSION:
        raise TraceError(
            f"{where}: trace schema version {version.decode()!r}, expected {SCHEMA_VERSION!r}"
        )
    for f in COLUMNS:
        idx = schema.get_field_index(f.name)
        if idx < 0:
            raise TraceError(f"{where}: missing column {f.name!r}")
        actual = schema.field(idx).type
        if actual not in _EQUIVALENT.get(f.type, (f.type,)):
            raise TraceError(f"{where}: column {f.name!r} has type {actual}, expected {f.type}")


def validate_table(table: pa.Table, where: str = "trace") -> None:
    """Check schema and values: no nulls where not allowed, run-times finite and > 0, workers in
    0..world_size-1, world_size in 1..MAX_WORLD_SIZE, iterations in 0..MAX_ITERATION, and no
    duplicate (run_id, iteration, worker)."""
    validate_schema(table.schema, where)
    validate_values(table, where)


def validate_values(table: pa.Table, where: str = "trace") -> None:
    """The value checks of :func:`validate_table`, for a table whose types were checked on read
    (polars hands back ``large_string`` where the file has ``string``)."""
    if table.num_rows == 0:
        raise TraceError(f"{where}: no rows")
    for f in COLUMNS:
        if not f.nullable and table[f.name].null_count:
            raise TraceError(f"{where}: column {f.name!r} has {table[f.name].null_count} null(s)")
    _check_runtimes(table, where)
    _check_workers(table, where)
    _check_unique(table, where)


def _check_runtimes(table: pa.Table, where: str) -> None:
    for name in ("runtime_s", "start_s"):
        col = table[name]
        bad = pc.invert(pc.is_finite(col))
        if pc.any(bad).as_py():
            row = pc.index(bad, True).as_py()
            raise TraceError(f"{where}: {name} is not finite at row {row} ({col[row].as_py()})")
    runtime = table["runtime_s"]
    nonpos = pc.less_equal(runtime, 0.0)
    if pc.any(nonpos).as_py():
        row = pc.index(nonpos, True).as_py()
        raise TraceError(f"{where}: runtime_s must be > 0, got {runtime[row].as_py()} at row {row}")
    negstart = pc.less(table["start_s"], 0.0)
    if pc.any(negstart).as_py():
        row = pc.index(negstart, True).as_py()
        raise TraceError(f"{where}: start_s must be >= 0 at row {row}")


def _check_workers(table: pa.Table, where: str) -> None:
    world, worker = table["world_size"], table["worker"]
    if pc.any(small := pc.less(world, 1)).as_py():
        row = pc.index(small, True).as_py()
        raise TraceError(f"{where}: world_size must be >= 1, got {world[row].as_py()} at row {row}")
    if (largest := pc.max(world).as_py()) > MAX_WORLD_SIZE:
        row = pc.index(world, largest).as_py()
        raise TraceError(f"{where}: world_size {largest} is above {MAX_WORLD_SIZE} at row {row}")
    out = pc.or_(pc.less(worker, 0), pc.greater_equal(worker, world))
    if pc.any(out).as_py():
        row = pc.index(out, True).as_py()
        raise TraceError(
            f"{where}: worker {worker[row].as_py()} outside 0..{world[row].as_py() - 1} at row {row}"
        )
    iteration = table["iteration"]
    if pc.any(negative := pc.less(iteration, 0)).as_py():
        row = pc.index(negative, True).as_py()
        raise TraceError(
            f"{where}: iteration must be >= 0, got {iteration[row].as_py()} at row {row}"
        )
    if (last := pc.max(iteration).as_py()) > MAX_ITERATION:
        row = pc.index(iteration, last).as_py()
        raise TraceError(f"{where}: iteration {last} is above {MAX_ITERATION} at row {row}")


def _check_unique(table: pa.Table, where: str) -> None:
    keys = table.select(["run_id", "iteration", "worker"])
    counts = keys.group_by(["run_id", "iteration", "worker"]).aggregate([([], "count_all")])
    if counts.num_rows != table.num_rows:
        dup = counts.filter(pc.greater(counts["count_all"], 1)).slice(0, 1).to_pylist()[0]
        same = pc.and_(
            pc.and_(pc.equal(keys["run_id"], dup["run_id"]),
                    pc.equal(keys["iteration"], dup["iteration"])),
            pc.equal(keys["worker"], dup["worker"]),
        )  # fmt: skip
        rows = pc.indices_nonzero(same).to_pylist()[:2]
        raise TraceError(
            f"{where}: duplicate row for run_id={dup['run_id']!r} "
            f"iteration={dup['iteration']} worker={dup['worker']} (rows {rows[0]} and {rows[1]})"
        )
