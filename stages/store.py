"""The trace store: a directory of schema-v1 Parquet files.

Appending writes a new file under a hidden temporary name (``.tmp-*``), fsyncs it and renames it
into place, so a crash never leaves a visible partial file and never touches earlier files.
Readers list only ``part-*.parquet`` and check each file's schema before a polars lazy scan.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from schemas import to_table, validate_schema, validate_table, validate_values
from stages.errors import TraceError

PART_GLOB = "part-*.parquet"


def new_run_id(source: str) -> str:
    """A sortable, unique run id such as ``profile-20261121T213900-1a2b3c``."""
    return f"{source}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class RunMatrix:
    """One run as arrays: ``runtimes[t, w]`` (seconds), ``censored[t, w]`` (True: real run-time
    >= the value), ``present[t, w]`` (False where the trace has no row, e.g. a dead worker)."""

    run_id: str
    runtimes: np.ndarray
    censored: np.ndarray
    present: np.ndarray
    hosts: tuple[str, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return self.runtimes.shape


class TraceStore:
    """Append-only directory of trace files."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    # -- writing ---------------------------------------------------------------------------
    def append(self, table: pa.Table | dict) -> Path:
        """Validate and atomically add one file; returns its final path."""
        if not isinstance(table, pa.Table):
            table = to_table(table)
        validate_table(table, where="rows to append")
        self._ensure_dir()
        name = f"part-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet"
        tmp = self.path / f".tmp-{name}"
        try:
            with open(tmp, "wb") as fh:
                pq.write_table(table, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path / name)
        except OSError as exc:
            raise TraceError(
                f"cannot write to trace store {self.path}: {_first_line(exc)}"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)
        return self.path / name

    def _ensure_dir(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TraceError(f"cannot create trace store {self.path}: {exc.strerror}") from None
        if not os.access(self.path, os.W_OK):
            raise TraceError(f"trace store {self.path} is not writable")

    def check_writable(self) -> None:
        """Fail early, before any work, if appending would fail."""
        self._ensure_dir()

    # -- reading ---------------------------------------------------------------------------
    def files(self) -> list[Path]:
        if not self.path.is_dir():
            return []
        return sorted(self.path.glob(PART_GLOB))

    def scan(self) -> pl.LazyFrame:
        """Lazy polars scan over every file, each file's schema checked first."""
        files = self.files()
        if not files:
            raise TraceError(f"trace store {self.path} holds no trace files")
        for f in files:
            validate_schema(_read_schema(f), where=str(f))
        # one scan per file, concatenated diagonally: an extra column that only some files have
        # (injected_delay_s, workload...) is kept, null elsewhere, whichever file comes first
        scans = [pl.scan_parquet(str(f)) for f in files]
        return pl.concat(scans, how="diagonal_relaxed")

    def read(self) -> pl.DataFrame:
        """All rows, values validated."""
        try:
            df = self.scan().collect()
        except pl.exceptions.PolarsError as exc:
            raise TraceError(f"cannot read trace store {self.path}: {_first_line(exc)}") from None
        validate_values(df.to_arrow(), where=str(self.path))
        return df

    def runs(self) -> pl.DataFrame:
        """One row per run: run_id, source, policy, world_size, iterations, rows."""
        return (
            self.read()
            .group_by("run_id")
            .agg(
                pl.col("source").first(),
                pl.col("policy").first(),
                pl.col("world_size").max(),
                (pl.col("iteration").max() + 1).alias("iterations"),
                pl.len().alias("rows"),
                pl.col("censored").sum().alias("censored_rows"),
            )
            .sort("run_id")
        )

    def run_matrices(self) -> list[RunMatrix]:
        """Every run as a :class:`RunMatrix`, sorted by run id."""
        df = self.read()
        return [
            to_run_matrix(df.filter(pl.col("run_id") == rid))
            for rid in sorted(df["run_id"].unique())
        ]

    def run_matrix(self, run_id: str, missing_ok: bool = False) -> RunMatrix | None:
        """One run as a :class:`RunMatrix`, read lazily (only that run's rows are loaded and
        validated). A run that is not there is an error, or None with ``missing_ok``."""
        if missing_ok and not self.files():
            return None
        try:
            df = self.scan().filter(pl.col("run_id") == run_id).collect()
        except pl.exceptions.PolarsError as exc:
            raise TraceError(f"cannot read trace store {self.path}: {_first_line(exc)}") from None
        if df.height == 0:
            if missing_ok:
                return None
            raise TraceError(f"no run {run_id!r} in {self.path}")
        validate_values(df.to_arrow(), where=f"{self.path} run {run_id}")
        return to_run_matrix(df)


def matrix_rows(run: RunMatrix, policy: str = "full", source: str = "import") -> dict[str, list]:
    """The schema-v1 rows of a (T, N) run (its present entries), for :meth:`TraceStore.append`:
    the inverse of :func:`to_run_matrix` for a run recorded without cutoffs."""
    it, wk = np.nonzero(run.present)
    n = run.runtimes.shape[1]
    rows = it.size
    return {
        "run_id": [run.run_id] * rows,
        "iteration": it.tolist(),
        "worker": wk.tolist(),
        "host": [run.hosts[w] for w in wk],
        "world_size": [n] * rows,
        "start_s": [0.0] * rows,
        "runtime_s": run.runtimes[it, wk].tolist(),
        "censored": run.censored[it, wk].tolist(),
        "cutoff": [None] * rows,
        "policy": [policy] * rows,
        "source": [source] * rows,
    }


def to_run_matrix(df: pl.DataFrame) -> RunMatrix:
    """Turn one run's rows into a (T x N) run-time matrix plus censoring and presence masks."""
    run_id = df["run_id"][0]
    n = int(df["world_size"].max())
    t = int(df["iteration"].max()) + 1
    it = df["iteration"].to_numpy()
    wk = df["worker"].to_numpy()
    runtimes = np.full((t, n), np.nan)
    censored = np.zeros((t, n), dtype=bool)
    present = np.zeros((t, n), dtype=bool)
    runtimes[it, wk] = df["runtime_s"].to_numpy()
    censored[it, wk] = df["censored"].to_numpy()
    present[it, wk] = True
    host_rows = df.group_by("worker").agg(pl.col("host").first())
    hosts = ["unknown"] * n
    for w, h in host_rows.iter_rows():
        hosts[w] = h
    return RunMatrix(run_id, runtimes, censored, present, tuple(hosts))


def read_trace_path(path: str | os.PathLike) -> pl.DataFrame:
    """Rows of a trace store directory or of a single schema-v1 Parquet file, validated."""
    p = Path(path)
    if p.is_dir():
        return TraceStore(p).read()
    if not p.is_file():
        raise TraceError(f"no trace at {p}")
    validate_schema(_read_schema(p), where=str(p))
    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{p}: not a readable Parquet file ({_first_line(exc)})") from None
    validate_table(table, where=str(p))
    return pl.from_arrow(table)


def _read_schema(path: Path) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{path}: not a readable Parquet file ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class TraceWriter:
    """Collects rows and appends them to a store in batches on a background thread, so the
    per-iteration path only puts a dict on a queue. At most one batch is lost on a crash."""

    def __init__(self, store: TraceStore, batch_rows: int = 2048):
        self.store = store
        self.batch_rows = batch_rows
        self._pending: dict[str, list] = {}
        self._n = 0
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.files: list[Path] = []
        self.rows_written = 0
        self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
        self._thread.start()

    def add(self, rows: dict[str, list]) -> None:
        """Add column-wise rows (all lists the same length)."""
        if self._error is not None:
            raise TraceError(f"writing traces failed: {self._error}")
        for k, v in rows.items():
            self._pending.setdefault(k, []).extend(v)
        self._n += len(next(iter(rows.values())))
        if self._n >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        if self._n:
            self._queue.put(self._pending)
            self._pending, self._n = {}, 0

    def close(self, timeout: float = 60.0) -> None:
        """Flush what is pending and wait for the writer thread (bounded)."""
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout)
        if self._error is not None:
            raise TraceError(f"writing traces failed: {self._error}")
        if self._thread.is_alive():
            raise TraceError(f"trace writer did not finish within {timeout:g} s")

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            try:
                self.files.append(self.store.append(batch))
                self.rows_written += len(batch["run_id"])
            except BaseException as exc:  # reported to the caller on its next add/close
                self._error = exc
