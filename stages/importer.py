"""``bdsgd import``: turn a run-time log written by another tool into schema-v1 traces.

The log is a CSV or Parquet file with one row per (iteration, worker). Three columns are needed
(iteration, worker, run-time); the flags name them. Everything else the schema wants is either
mapped from a column too or filled in:

- ``run_id``: the ``--run-col`` column, else ``--run-id``, else a new id ``import-...``;
- ``host``: the ``--host-col`` column, else ``"unknown"``;
- ``censored``: the ``--censored-col`` column (bool, 0/1 or "true"/"false"), else False;
- ``start_s``: the ``--start-col`` column, else the cumulative sum of the worker's earlier
  run-times in the run (iterations in order): the worker is taken to start iteration t the moment
  it finished t-1, which is exact for a worker that never waited;
- ``world_size``: the ``--world-size-col`` column, else the largest worker rank of the run + 1;
- ``cutoff`` null, ``policy`` and ``source`` ``"import"``.

An optional column left unnamed is still used when the log has a column of the schema's own name
(``run_id``, ``host``, ``censored``, ``start_s``, ``world_size``). Worker ids that are not already
the integers 0..N-1 of their run (host names, sparse ids such as 4, 8, 12) become dense ranks in
sorted order within the run (numeric order for numbers, lexicographic for text). Other columns of
the log are not kept. Nothing is written unless every row passes the schema-v1 checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
from bdsgd.schemas import to_table, validate_table
from bdsgd.stages.errors import ConfigError, TraceError, first_line
from bdsgd.stages.store import TraceStore, new_run_id

FORMATS = ("auto", "csv", "parquet")
PARQUET_SUFFIXES = (".parquet", ".pq")
# schema column -> its optional mapping field of ImportConfig
OPTIONAL_COLUMNS = {
    "run_id": "run_col",
    "host": "host_col",
    "censored": "censored_col",
    "start_s": "start_col",
    "world_size": "world_size_col",
}
DEFAULT_HOST = "unknown"
IMPORT_POLICY = "import"


@dataclass(frozen=True, kw_only=True)
class ImportConfig:
    """What ``bdsgd import`` reads, where it writes and how the log's columns map onto schema v1."""

    path: Path
    """The log to import: a CSV or Parquet file."""
    traces: Path
    """Trace store directory the rows are appended to (created if missing)."""
    iteration_col: str = "iteration"
    """Column holding the 0-based iteration (integers >= 0, kept as they are)."""
    worker_col: str = "worker"
    """Column identifying the worker: ranks, sparse integers or names (mapped to dense ranks)."""
    runtime_col: str = "runtime_s"
    """Column holding the run-time in seconds (finite, > 0)."""
    run_col: str | None = None
    """Column naming the run; None: ``run_id`` if the log has it, else one run for the file."""
    host_col: str | None = None
    """Column naming the worker's host; None: ``host`` if present, else ``"unknown"``."""
    censored_col: str | None = None
    """Column of censoring flags; None: ``censored`` if present, else every row uncensored."""
    start_col: str | None = None
    """Column of start times (s since run start); None: ``start_s`` if present, else cumulative."""
    world_size_col: str | None = None
    """Column of world sizes; None: ``world_size`` if present, else max rank + 1 per run."""
    run_id: str | None = None
    """Run id for every row when the log has no run column; None: a new ``import-...`` id."""
    format: str = "auto"
    """``csv``, ``parquet`` or ``auto`` (Parquet for ``.parquet``/``.pq`` files, CSV otherwise)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        object.__setattr__(self, "traces", Path(self.traces))
        if self.format not in FORMATS:
            raise ConfigError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        required = (self.iteration_col, self.worker_col, self.runtime_col)
        if any(not col for col in required):
            raise ConfigError("--iteration-col, --worker-col and --runtime-col must not be empty")
        named = [c for c in (*required, *self._optional_flags().values()) if c is not None]
        if len(set(named)) != len(named):
            raise ConfigError(f"one input column mapped to two schema columns: {named}")
        if self.run_id is not None and (not self.run_id.strip() or self.run_col is not None):
            raise ConfigError("--run-id must be non-empty and cannot be combined with --run-col")

    def _optional_flags(self) -> dict[str, str | None]:
        return {schema: getattr(self, name) for schema, name in OPTIONAL_COLUMNS.items()}


@dataclass(frozen=True)
class ImportResult:
    """What an import wrote."""

    rows: int
    """Rows appended."""
    runs: list[str]
    """Run ids of the imported rows, sorted."""
    traces: Path
    """The trace store written to."""
    files: list[Path] = field(default_factory=list)
    """The new Parquet files in the store."""


def run_import(config: ImportConfig) -> ImportResult:
    """Read the log, map it onto schema v1, validate every row and append it as one file."""
    raw = read_log(config.path, config.format)
    mapping = resolve_columns(config, raw.columns)
    rows = build_rows(raw, mapping, config)
    table = to_table(rows.to_dict(as_series=False))
    try:
        validate_table(table, where=str(config.path))
    except TraceError as exc:
        raise TraceError(_name_input_column(str(exc), mapping)) from None
    store = TraceStore(config.traces)
    runs = sorted(set(rows["run_id"].to_list()))
    _check_new_runs(store, runs)
    written = store.append(table)
    return ImportResult(rows=table.num_rows, runs=runs, traces=store.path, files=[written])


def read_log(path: Path, fmt: str = "auto") -> pl.DataFrame:
    """The log as a polars frame; a missing, unreadable or empty file is a one-line TraceError."""
    if not path.is_file():
        raise TraceError(f"no such file: {path}")
    is_parquet = fmt == "parquet" or (fmt == "auto" and path.suffix.lower() in PARQUET_SUFFIXES)
    try:
        if is_parquet:
            df = pl.read_parquet(path)
        else:
            df = pl.read_csv(path, infer_schema_length=None)
    except (pl.exceptions.PolarsError, OSError, UnicodeDecodeError) as exc:
        kind = "Parquet" if is_parquet else "CSV"
        raise TraceError(f"{path}: not a readable {kind} file ({first_line(exc)})") from None
    if df.height == 0:
        raise TraceError(f"{path}: no rows to import")
    return df


def resolve_columns(config: ImportConfig, available: list[str]) -> dict[str, str]:
    """Schema column -> input column, for every column the log provides; a named column that the
    log lacks is an error listing what it has."""
    mapping = {
        "iteration": config.iteration_col,
        "worker": config.worker_col,
        "runtime_s": config.runtime_col,
    }
    for schema_col, flag_value in config._optional_flags().items():
        if flag_value is not None:
            mapping[schema_col] = flag_value
        elif schema_col in available and schema_col not in mapping.values():
            mapping[schema_col] = schema_col
    if config.run_id is not None:
        mapping.pop("run_id", None)
    missing = [col for col in mapping.values() if col not in available]
    if missing:
        have = ", ".join(available[:20])
        raise TraceError(f"{config.path}: no column {missing[0]!r} (columns: {have})")
    return mapping


def build_rows(raw: pl.DataFrame, mapping: dict[str, str], config: ImportConfig) -> pl.DataFrame:
    """The eleven schema columns, typed, defaults filled, in the log's row order (so a row number
    in an error is the log's data row, counting from 0)."""
    n = raw.height
    for schema_col in ("iteration", "worker", "runtime_s"):
        _required(raw, mapping[schema_col])
    cols = {
        "run_id": _run_ids(raw, mapping, config),
        "iteration": _integers(raw, mapping["iteration"]),
        "worker": _worker_keys(raw[mapping["worker"]]),
        "runtime_s": _floats(raw, mapping["runtime_s"]),
        "host": _strings(raw, mapping["host"]) if "host" in mapping else [DEFAULT_HOST] * n,
        "censored": _bools(raw, mapping["censored"]) if "censored" in mapping else [False] * n,
    }
    df = pl.DataFrame(cols).with_columns(worker=_dense_workers())
    if "start_s" in mapping:
        df = df.with_columns(start_s=_floats(raw, mapping["start_s"]))
    else:
        df = df.with_columns(start_s=_cumulative_start())
    if "world_size" in mapping:
        df = df.with_columns(world_size=_integers(raw, mapping["world_size"]))
    else:
        df = df.with_columns(world_size=pl.col("worker").max().over("run_id") + 1)
    df = df.with_columns(
        cutoff=pl.lit(None, dtype=pl.Int32),
        policy=pl.lit(IMPORT_POLICY),
        source=pl.lit("import"),
    )
    return df


def _run_ids(raw: pl.DataFrame, mapping: dict[str, str], config: ImportConfig) -> pl.Series:
    if "run_id" in mapping:
        return _strings(raw, mapping["run_id"])
    return pl.Series([config.run_id or new_run_id("import")] * raw.height, dtype=pl.String)


def _worker_keys(series: pl.Series) -> pl.Series:
    """Worker ids as integers when every id is a whole number, else as text (sort order)."""
    as_float = series.cast(pl.Float64, strict=False)
    whole = as_float.is_not_null() & as_float.is_finite() & (as_float == as_float.floor())
    if (whole | series.is_null()).all():
        return as_float.cast(pl.Int64)
    return series.cast(pl.String)


def _dense_workers() -> pl.Expr:
    """Keep ranks that already are 0..N-1 within their run; map anything else to dense ranks."""
    w = pl.col("worker")
    dense = (w.rank("dense") - 1).cast(pl.Int64)
    if_ranks = w.cast(pl.Int64, strict=False)
    is_ranks = (if_ranks.min() == 0) & (if_ranks.max() + 1 == if_ranks.n_unique())
    return pl.when(is_ranks.over("run_id")).then(if_ranks).otherwise(dense.over("run_id"))


def _cumulative_start() -> pl.Expr:
    """Start of iteration t = sum of the worker's run-times at its earlier iterations."""
    runtime = pl.col("runtime_s")
    order = pl.col("iteration")
    earlier = runtime.cum_sum().over(["run_id", "worker"], order_by=order) - runtime
    return earlier.clip(lower_bound=0.0)


def _floats(raw: pl.DataFrame, col: str) -> pl.Series:
    return _cast(raw[col], pl.Float64, col, "numbers")


def _integers(raw: pl.DataFrame, col: str) -> pl.Series:
    values = _floats(raw, col)
    whole = values.is_null() | (
        values.is_finite() & (values == values.floor()) & (values.abs() < 2.0**62)
    )
    if not whole.all():
        row = _first(~whole)
        raise TraceError(f"column {col!r} must hold whole numbers, got {values[row]} at row {row}")
    return values.cast(pl.Int64)


def _first(mask: pl.Series) -> int:
    """The first row where ``mask`` holds (the log's data rows, from 0)."""
    return int(mask.arg_true()[0])


def _required(raw: pl.DataFrame, col: str) -> None:
    """A column every row needs (iteration, worker, run-time) has no empty cell."""
    if raw[col].null_count():
        raise TraceError(f"column {col!r} is empty at row {_first(raw[col].is_null())}")


def _strings(raw: pl.DataFrame, col: str) -> pl.Series:
    return raw[col].cast(pl.String)


def _bools(raw: pl.DataFrame, col: str) -> pl.Series:
    series = raw[col]
    if series.dtype == pl.Boolean:
        return series
    text = series.cast(pl.String).str.to_lowercase().str.strip_chars()
    allowed = {"true": True, "false": False, "1": True, "0": False}
    bad = text.filter(text.is_not_null() & ~text.is_in(list(allowed)))
    if bad.len():
        row = _first(text.is_not_null() & ~text.is_in(list(allowed)))
        raise TraceError(f"column {col!r} must hold true/false or 1/0, got {bad[0]!r} at row {row}")
    return text.replace_strict(allowed, default=None, return_dtype=pl.Boolean)


def _cast(series: pl.Series, dtype: pl.DataType, col: str, what: str) -> pl.Series:
    if series.dtype == pl.String:
        series = series.str.strip_chars()
    cast = series.cast(dtype, strict=False)
    failed = cast.is_null() & series.is_not_null()
    if failed.any():
        row = _first(failed)
        raise TraceError(f"column {col!r} must hold {what}, got {series[row]!r} at row {row}")
    return cast


def _check_new_runs(store: TraceStore, runs: list[str]) -> None:
    """Refuse run ids the store already holds: appending would duplicate rows for good."""
    if not store.files():
        return
    existing = set(store.scan().select("run_id").unique().collect()["run_id"].to_list())
    clash = sorted(existing.intersection(runs))
    if clash:
        raise TraceError(
            f"trace store {store.path} already holds run {clash[0]!r}; pass another --run-id"
        )


def _name_input_column(message: str, mapping: dict[str, str]) -> str:
    """Add the log's own column name to a schema error that names a renamed column."""
    for schema_col in ("runtime_s", "start_s", "censored", "world_size", "host", "iteration"):
        source = mapping.get(schema_col)
        if schema_col in message and source is not None and source != schema_col:
            return f"{message} (input column {source!r})"
    return message
