"""The trace store: a directory of schema-v1 Parquet files.

Appending writes a new file under a hidden temporary name (``.tmp-*``), fsyncs it and renames it
into place, so a crash never leaves a visible partial file and never touches earlier files.
Readers list only ``part-*.parquet`` and check each file's schema and values, naming a bad file;
with ``skip_bad_files`` they leave it out (with a note) and read the rest. No reader modifies a
file, and none allocates by the largest iteration or world size seen (:func:`to_run_matrix`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from bdsgd.schemas import to_table, validate_schema, validate_table, validate_values
from bdsgd.stages.console import console
from bdsgd.stages.errors import TraceError, first_line
from bdsgd.stages.ids import new_run_id  # noqa: F401 (the run ids of every writer)
from rich.markup import escape

PART_GLOB = "part-*.parquet"


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
    """Append-only directory of trace files. ``skip_bad_files``: True leaves out a file that is
    unreadable or not valid schema v1 (with a note); False refuses it with a hint at
    ``--skip-bad-files``; None (callers without that option) refuses it without one."""

    def __init__(
        self, path: str | os.PathLike, skip_bad_files: bool | None = None, quiet: bool = False
    ):
        self.path = Path(path)
        self.skip_bad_files = skip_bad_files
        self.quiet = quiet  # no note per file left out (the caller reports :attr:`problems`)
        self.skipped: list[Path] = []  # the files left out by the last read
        self.problems: dict[Path, str] = {}  # why each was left out

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
                f"cannot write to trace store {self.path}: {first_line(exc)}"
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

    def check_writable(self) -> Callable[[], None]:
        """Fail early, before any work, if appending would fail. Returns what removes the
        directories this made, while they are still empty (a run that fails before its first
        row leaves no empty store behind)."""
        created = [p for p in (self.path, *self.path.parents) if not p.exists()]  # deepest first
        self._ensure_dir()

        def undo() -> None:
            for path in created:
                if not path.is_dir() or any(path.iterdir()):
                    return
                path.rmdir()

        return undo

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
        """All rows, validated (each file's schema, the values, no row in two files)."""
        df = self.rows(None, where=str(self.path))
        if df.height == 0:
            raise TraceError(f"{self.path}: no rows")
        return df

    def rows(self, run_id: str | None, where: str) -> pl.DataFrame:
        """The rows (only ``run_id``'s, when given), validated; possibly none. One scan of every
        file; when that finds something wrong, the files are checked one by one to name (or,
        with ``skip_bad_files``, leave out) the bad one."""
        files = self.files()
        if not files:
            raise TraceError(f"trace store {self.path} holds no trace files")
        self.skipped, self.problems = [], {}
        try:
            df = _scan_rows(files, run_id)
            if df.height:
                validate_values(df.to_arrow(), where=where)
                check_dense(df)
            return df
        except TraceError:
            pass
        kept = [(f, rows) for f, rows in self._good_file_rows(files, run_id) if rows.height]
        for f, reason in across_files(kept):  # what no single file shows
            self._bad_file(f, TraceError(f"{f}: {reason}"))
        frames = [rows for f, rows in kept if f not in self.problems]
        if not frames:
            return _scan_rows([], run_id)
        df = pl.concat(frames, how="diagonal_relaxed")
        validate_values(df.to_arrow(), where=where)
        return df

    def _good_file_rows(
        self, files: list[Path], run_id: str | None
    ) -> list[tuple[Path, pl.DataFrame]]:
        """Each file's rows checked on its own; a bad file is refused by name, or skipped."""
        out = []
        for f in files:
            try:
                out.append((f, _checked_rows(f, run_id)))
            except TraceError as exc:
                self._bad_file(f, exc)
        return out

    def _bad_file(self, path: Path, exc: TraceError) -> None:
        """Refuse ``path`` (with how to read without it), or leave it out with a note."""
        if not self.skip_bad_files:
            hint = "--skip-bad-files leaves it out; " if self.skip_bad_files is False else ""
            raise TraceError(
                f"{exc} ({hint}bdsgd check-traces {self.path} --repair moves it aside)"
            ) from None
        self.skipped.append(path)
        self.problems[path] = str(exc)
        if not self.quiet:
            console.print(
                f"[yellow]skipping a bad trace file[/] {escape(str(exc))}", soft_wrap=True
            )

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

    def latest_run_id(self) -> str:
        """The run that wrote the store's newest file (file names begin with the time they were
        written: after a ``train``, that run). Only that file is read; a bad one is refused, or
        with ``skip_bad_files`` left out for the one before it."""
        files = self.files()
        if not files:
            raise TraceError(f"trace store {self.path} holds no trace files")
        for f in reversed(files):
            for _, frame in self._good_file_rows([f], None):
                return str(frame["run_id"][-1])
        raise TraceError(f"{self.path}: no rows")

    def run_matrix(self, run_id: str, missing_ok: bool = False) -> RunMatrix | None:
        """One run as a :class:`RunMatrix`, read lazily (only that run's rows are loaded and
        validated). A run that is not there is an error, or None with ``missing_ok``."""
        if missing_ok and not self.files():
            return None
        df = self.rows(run_id, where=f"{self.path} run {run_id}")
        if df.height == 0:
            if missing_ok:
                return None
            raise TraceError(f"no run {run_id!r} in {self.path}")
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


MATRIX_FLOOR = 1 << 24
"""Cells a run's (T x N) matrix may always have; beyond, at most :data:`MATRIX_PER_ROW` per row."""
MATRIX_PER_ROW = 64


def sparse_runs(df: pl.DataFrame) -> list[str]:
    """The runs whose (T x N) matrix :func:`to_run_matrix` refuses: mostly empty cells."""
    sizes = df.group_by("run_id").agg(
        (pl.col("iteration").max() + 1).alias("t"), pl.col("world_size").max().alias("n"), pl.len()
    )
    too_big = (pl.col("t") * pl.col("n")) > pl.max_horizontal(
        pl.lit(MATRIX_FLOOR), pl.col("len") * MATRIX_PER_ROW
    )
    return sorted(sizes.filter(too_big)["run_id"].to_list())


def check_dense(df: pl.DataFrame) -> None:
    """Raise when a run's matrix would be mostly empty (a file of it is then named)."""
    if runs := sparse_runs(df):
        raise TraceError(f"run {runs[0]!r} is sparse")


def across_files(kept: list[tuple[Path, pl.DataFrame]]) -> list[tuple[Path, str]]:
    """Files that are bad only beside the others, in file order, each with why: a file holding
    a row an earlier file holds (a copied part file, two runs into one run directory), and the
    file holding the largest iteration of a run whose matrix would be mostly empty (an
    iteration far beyond the others). Leaving these out leaves a readable store."""
    if not kept:
        return []
    keys = pl.concat(
        [rows.select("run_id", "iteration", "worker").with_columns(file=pl.lit(k))
         for k, (_, rows) in enumerate(kept)]
    )  # fmt: skip
    first = keys.group_by("run_id", "iteration", "worker").agg(pl.col("file").min().alias("first"))
    repeats = keys.join(first, on=["run_id", "iteration", "worker"]).filter(
        pl.col("file") > pl.col("first")
    )
    bad: dict[int, str] = {}
    for row in repeats.unique("file", keep="first", maintain_order=True).iter_rows(named=True):
        bad[row["file"]] = (
            f"repeats the row run_id={row['run_id']!r} iteration={row['iteration']} "
            f"worker={row['worker']} of {kept[row['first']][0].name}"
        )
    rest = [(k, rows) for k, (_, rows) in enumerate(kept) if k not in bad]
    bad.update(_sparse_holders(rest))
    return [(kept[k][0], bad[k]) for k in sorted(bad)]


def _sparse_holders(kept: list[tuple[int, pl.DataFrame]]) -> dict[int, str]:
    """For each sparse run, the file holding its largest iteration, until no run is sparse."""
    bad: dict[int, str] = {}
    while kept:
        df = pl.concat(
            [rows.select("run_id", "iteration", "world_size").with_columns(file=pl.lit(k))
             for k, rows in kept]
        )  # fmt: skip
        runs = sparse_runs(df)
        if not runs:
            return bad
        last = df.filter(pl.col("run_id") == runs[0]).sort("iteration").tail(1).row(0, named=True)
        bad[last["file"]] = (
            f"iteration {last['iteration']} of run {runs[0]!r} lies far beyond the run's other "
            "rows (its iterations x world size would be mostly empty cells)"
        )
        kept = [(k, rows) for k, rows in kept if k != last["file"]]
    return bad


def to_run_matrix(df: pl.DataFrame) -> RunMatrix:
    """Turn one run's rows into a (T x N) run-time matrix plus censoring and presence masks.
    T and N come from the largest iteration and world size: a run whose matrix would be mostly
    empty (more than 64 cells per row, beyond 16M cells) is refused before anything is
    allocated, so a corrupt or hostile value cannot size it."""
    run_id = df["run_id"][0]
    n = int(df["world_size"].max())
    t = int(df["iteration"].max()) + 1
    if t * n > max(MATRIX_FLOOR, MATRIX_PER_ROW * df.height):
        raise TraceError(
            f"run {run_id!r}: {df.height} rows spread over iterations up to {t - 1} and a "
            f"world size of {n} ({t}x{n} cells): not a run this reader holds"
        )
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
        raise TraceError(f"{p}: not a readable Parquet file ({first_line(exc)})") from None
    validate_table(table, where=str(p))
    return pl.from_arrow(table)


def _scan_rows(files: list[Path], run_id: str | None) -> pl.DataFrame:
    """Every file's rows in one scan (only ``run_id``'s, when given), each file's schema
    checked; diagonally, so an extra column only some files have is kept, null elsewhere."""
    for f in files:
        _checked_footer(f)
    if not files:
        return pl.DataFrame(schema={"run_id": pl.String})
    scan = pl.concat([pl.scan_parquet(str(f)) for f in files], how="diagonal_relaxed")
    try:
        return (scan.filter(pl.col("run_id") == run_id) if run_id is not None else scan).collect()
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise TraceError(f"cannot read a trace file: {first_line(exc)}") from None


def _checked_rows(path: Path, run_id: str | None) -> pl.DataFrame:
    """A file's rows (only ``run_id``'s, when given), schema and values checked, errors naming
    the file."""
    _checked_footer(path)
    try:
        scan = pl.scan_parquet(str(path))
        df = (scan.filter(pl.col("run_id") == run_id) if run_id is not None else scan).collect()
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise TraceError(f"{path}: not a readable Parquet file ({first_line(exc)})") from None
    if df.height:
        validate_values(df.to_arrow(), where=str(path))
    return df


def _read_footer(path: Path) -> tuple[pa.Schema, int]:
    """A file's schema and row count, from its footer alone."""
    try:
        parquet = pq.ParquetFile(path)
        return parquet.schema_arrow, parquet.metadata.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{path}: not a readable Parquet file ({first_line(exc)})") from None


def _checked_footer(path: Path) -> None:
    """The file's schema is v1 and it holds a row."""
    schema, rows = _read_footer(path)
    validate_schema(schema, where=str(path))
    if rows == 0:
        raise TraceError(f"{path}: no rows (a trace file holds at least one)")


def _read_schema(path: Path) -> pa.Schema:
    return _read_footer(path)[0]


class TraceWriter:
    """Collects rows and appends them to a store in batches on a background thread, so the
    per-iteration path only puts a dict on a queue. At most one batch is lost on a crash. After
    a failed append it writes nothing more (a later batch landing would leave a gap in the
    traces): every later call raises that failure."""

    def __init__(self, store: TraceStore, batch_rows: int = 2048):
        self.store = store
        self.batch_rows = batch_rows
        self._pending: dict[str, list] = {}
        self._n = 0
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._dropped = False  # abandon(): what is queued is not written
        self.files: list[Path] = []
        self.rows_written = 0
        self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
        self._thread.start()

    def add(self, rows: dict[str, list]) -> None:
        """Add column-wise rows (all lists the same length)."""
        self._raise_failure()
        for k, v in rows.items():
            self._pending.setdefault(k, []).extend(v)
        self._n += len(next(iter(rows.values())))
        if self._n >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        if self._n:
            self._queue.put(self._pending)
            self._pending, self._n = {}, 0

    def wait_written(self, rows: int, timeout: float) -> None:
        """Return once ``rows`` rows in all are on disk; raise as soon as an append failed, or
        after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.rows_written < rows:
            self._raise_failure()
            if time.monotonic() > deadline:
                raise TraceError(f"the trace writer did not write its rows within {timeout:g} s")
            time.sleep(0.005)

    def close(self, timeout: float = 60.0) -> None:
        """Flush what is pending and wait for the writer thread (bounded)."""
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout)
        self._raise_failure()
        if self._thread.is_alive():
            raise TraceError(f"trace writer did not finish within {timeout:g} s")

    def abandon(self, timeout: float = 60.0) -> None:
        """Stop without writing what is pending or queued (rows no checkpoint counts)."""
        self._pending, self._n, self._dropped = {}, 0, True
        self._queue.put(None)
        self._thread.join(timeout)

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise TraceError(f"writing traces failed: {self._error}")

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            if self._error is not None or self._dropped:
                continue
            try:
                self.files.append(self.store.append(batch))
                self.rows_written += len(batch["run_id"])
            except BaseException as exc:  # reported to the caller on its next call
                self._error = exc
