"""``bdsgd check-traces DIR [--repair]``: check every file of a trace store as the readers do
(each file's schema and values, at least one row) and what only shows across files: rows a
later file holds again (the same (run, iteration, worker) twice, or one job's iterations written
again under a second run id) and a run whose iterations would be a mostly empty matrix. With
``repair``, each bad file moves into the store's :data:`QUARANTINE` folder, which readers do not
list; a file that repeats some rows leaves its other rows behind in a new part file that sorts
where it did. Nothing is deleted or overwritten: a quarantined file can be inspected, fixed,
and moved back.

One job under two run ids: a run whose first iteration is above 0 was resumed, not started; it
continues the latest earlier run (by file order) of the same world size and source whose
iterations reach its first one. The iterations both runs hold are the job's iterations twice,
and the copy in the later file is the one reported and moved."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from bdsgd.stages.errors import TraceError, first_line
from bdsgd.stages.store import TraceStore, across_files, sparse_runs

QUARANTINE = "quarantine"
REST_SUFFIX = "-rest"
"""Added to a quarantined file's stem to name the file that keeps its other rows."""
KEY = ["run_id", "iteration", "worker"]


@dataclass(frozen=True, kw_only=True)
class CheckTracesConfig:
    traces: Path
    """The trace store to check."""
    repair: bool = False
    """Move every bad file into ``traces/quarantine/`` (never deletes, never overwrites)."""


@dataclass(frozen=True)
class Copy:
    """Rows of one run in a later file that an earlier file holds too."""

    file: Path
    of_file: Path
    run_id: str
    of_run_id: str
    rows: int
    first_iteration: int
    last_iteration: int

    @property
    def other_run(self) -> bool:
        """True: the earlier copy is under another run id (one job under two ids)."""
        return self.run_id != self.of_run_id

    def why(self) -> str:
        """One clause naming both files and the rows."""
        its = f"iterations {self.first_iteration}-{self.last_iteration} of run {self.run_id!r}"
        if not self.other_run:
            return f"repeats {self.rows} row(s) ({its}) that {self.of_file.name} holds"
        return (
            f"repeats {its} ({self.rows} rows) that {self.of_file.name} holds under run "
            f"{self.of_run_id!r}: one job's iterations under two run ids (a resumed run)"
        )


@dataclass(frozen=True)
class CheckResult:
    files: int
    """Trace files the store held when checked."""
    rows: int
    """Rows of the good files."""
    bad: dict[Path, str] = field(default_factory=dict)
    """Each bad file and why (one problem each)."""
    moved: dict[Path, Path] = field(default_factory=dict)
    """Each quarantined file and where it went (``repair``)."""
    copies: list[Copy] = field(default_factory=list)
    """The repeated rows, by file: the later file of each pair is bad."""
    kept: dict[Path, Path] = field(default_factory=dict)
    """Each quarantined file that also held rows no other file holds, and the file keeping
    them (``repair``)."""

    def problem_counts(self) -> dict[str, int]:
        """Bad files by kind: ``other_run`` (repeats another run id's iterations), ``same_run``
        (repeats rows of its own run), ``invalid`` (unreadable, invalid, or sparse)."""
        kinds = {c.file: "same_run" for c in self.copies}
        kinds |= {c.file: "other_run" for c in self.copies if c.other_run}
        counts = {"other_run": 0, "same_run": 0, "invalid": 0}
        for path in self.bad:
            counts[kinds.get(path, "invalid")] += 1
        return counts


def check_traces(config: CheckTracesConfig) -> CheckResult:
    """Check the store (a store without files is an error); quarantine its bad files if asked."""
    store = TraceStore(config.traces, skip_bad_files=True, quiet=True)
    if not store.path.is_dir():
        raise TraceError(f"no trace store at {store.path}")
    files = store.files()
    if not files:
        raise TraceError(f"trace store {store.path} holds no trace files")
    kept = store._good_file_rows(files, None)  # each file checked on its own; bad ones noted
    keys = file_keys(kept)
    repeated = copy_rows(keys)
    copies = summarize(repeated, [f for f, _ in kept])
    bad = dict(store.problems) | reasons(copies)
    sparse = sparse_files(kept, keys, repeated)
    bad |= {f: f"{bad[f]}; {why}" if f in bad else why for f, why in sparse.items()}
    good_rows = sum(rows.height for f, rows in kept if f not in bad)
    if not config.repair:
        return CheckResult(len(files), good_rows, bad, copies=copies)
    partly = {c.file for c in copies} - sparse.keys()
    others = {f: other_rows(rows, repeated, k) for k, (f, rows) in enumerate(kept) if f in partly}
    moved, rest = repair(bad, others)
    return CheckResult(len(files), good_rows, bad, moved, copies, rest)


def file_keys(kept: list[tuple[Path, pl.DataFrame]]) -> pl.DataFrame:
    """The key columns of every row, with its file's index in ``kept`` and its row there."""
    frames = [
        rows.select(*KEY, "world_size", "source")
        .with_row_index("row")
        .with_columns(file=pl.lit(k, pl.Int64))
        for k, (_, rows) in enumerate(kept)
    ]
    if not frames:
        return pl.DataFrame(schema=_COPY_SCHEMA | {"world_size": pl.Int32, "source": pl.String})
    return pl.concat(frames, how="vertical_relaxed")


_COPY_SCHEMA = {
    "file": pl.Int64, "row": pl.UInt32, "run_id": pl.String, "iteration": pl.Int64,
    "worker": pl.Int32, "of_file": pl.Int64, "of_run_id": pl.String,
}  # fmt: skip


def copy_rows(keys: pl.DataFrame) -> pl.DataFrame:
    """The rows that repeat a row of an earlier file: ``file``, ``row``, the key, ``of_file``
    and ``of_run_id`` (where the earlier copy is). Only rows that may repeat one (a key held
    twice, a resumed run's first iterations) are joined."""
    same = same_run_copies(keys)
    other = other_run_copies(keys, same.select("file", "row"))
    copies = pl.concat([same, other], how="vertical_relaxed")
    return copies.unique(["file", "row"], keep="first", maintain_order=True)


def same_run_copies(keys: pl.DataFrame) -> pl.DataFrame:
    """The same (run_id, iteration, worker) in two files: the copies in the later files."""
    twice = keys.filter(keys.select(KEY).is_duplicated())
    first = twice.group_by(KEY).agg(pl.col("file").min().alias("of_file"))
    later = twice.join(first, on=KEY).filter(pl.col("file") > pl.col("of_file"))
    return later.with_columns(of_run_id=pl.col("run_id")).select(_COPY_SCHEMA.keys())


def other_run_copies(keys: pl.DataFrame, same: pl.DataFrame) -> pl.DataFrame:
    """The (iteration, worker) cells a resumed run and the run it continues both hold (rows
    in ``same``, copies within a run, left out): the copy in the later file of each pair."""
    pairs = continued_runs(keys)
    window = pl.col("iteration").is_between(pl.col("lo"), pl.col("hi"))
    mine = keys.join(pairs, on="run_id").filter(window)
    theirs = keys.join(pairs.rename({"run_id": "child", "of_run_id": "run_id"}), on="run_id")
    both = (
        mine.join(same, on=["file", "row"], how="anti")
        .join(
            theirs.filter(window).join(same, on=["file", "row"], how="anti"),
            left_on=["of_run_id", "iteration", "worker", "run_id"],
            right_on=["run_id", "iteration", "worker", "child"],
            suffix="_of",
        )
    )  # fmt: skip
    later = pl.col("file") >= pl.col("file_of")
    return pl.concat([
        both.filter(later).select(
            "file", "row", "run_id", "iteration", "worker", of_file="file_of",
            of_run_id="of_run_id"),
        both.filter(~later).select(
            file="file_of", row="row_of", run_id="of_run_id", iteration="iteration",
            worker="worker", of_file="file", of_run_id="run_id"),
    ]).select(_COPY_SCHEMA.keys())  # fmt: skip


def continued_runs(keys: pl.DataFrame) -> pl.DataFrame:
    """Each resumed run (first iteration above 0), the run it continues (``of_run_id``): the
    latest-begun earlier run of the same world size and source whose iterations reach the
    resumed run's first one, and the iterations both may hold (``lo``..``hi``)."""
    runs = keys.group_by("run_id").agg(
        pl.col("iteration").min().alias("first"),
        pl.col("iteration").max().alias("last"),
        pl.col("file").min().alias("since"),
        pl.col("world_size").max(),
        pl.col("source").first(),
    )
    continues = (
        (pl.col("run_id") != pl.col("run_id_of"))
        & (pl.col("first_of") < pl.col("first"))
        & (pl.col("first") <= pl.col("last_of"))
        & (pl.col("since_of") <= pl.col("since"))
    )
    return (
        runs.filter(pl.col("first") > 0)
        .join(runs, on=["world_size", "source"], suffix="_of")
        .filter(continues)
        .sort("since_of", "run_id_of")
        .group_by("run_id")
        .agg(pl.col("run_id_of").last().alias("of_run_id"), pl.col("first").first().alias("lo"),
             pl.col("last_of").last().alias("hi"))
    )  # fmt: skip


def sparse_files(
    kept: list[tuple[Path, pl.DataFrame]], keys: pl.DataFrame, repeated: pl.DataFrame
) -> dict[Path, str]:
    """The files holding the largest iteration of a run that would be mostly empty cells,
    copies left out, each with why (the files are looked at one by one only when a run is)."""
    if not sparse_runs(keys.join(repeated.select("file", "row"), on=["file", "row"], how="anti")):
        return {}
    rest = [(f, rows[other_rows(rows, repeated, k)]) for k, (f, rows) in enumerate(kept)]
    return dict(across_files([(f, rows) for f, rows in rest if rows.height]))


def summarize(repeated: pl.DataFrame, files: list[Path]) -> list[Copy]:
    """One :class:`Copy` per (later file, earlier file, run, earlier run), in file order."""
    groups = (
        repeated.group_by("file", "of_file", "run_id", "of_run_id")
        .agg(pl.len().alias("rows"), pl.col("iteration").min().alias("lo"),
             pl.col("iteration").max().alias("hi"))
        .sort("file", "of_file", "run_id", "of_run_id")
    )  # fmt: skip
    return [
        Copy(files[g["file"]], files[g["of_file"]], g["run_id"], g["of_run_id"], g["rows"],
             g["lo"], g["hi"])
        for g in groups.iter_rows(named=True)
    ]  # fmt: skip


def reasons(copies: list[Copy]) -> dict[Path, str]:
    """Why each file holding copies is bad: every copy it holds, in one line."""
    out: dict[Path, str] = {}
    for c in copies:
        out[c.file] = f"{out[c.file]}; {c.why()}" if c.file in out else f"{c.file}: {c.why()}"
    return out


def other_rows(rows: pl.DataFrame, repeated: pl.DataFrame, k: int) -> pl.Series:
    """The indices of file ``k``'s rows that are not copies."""
    copies = repeated.filter(pl.col("file") == k)["row"].cast(pl.Int64)
    index = pl.Series("row", range(rows.height), dtype=pl.Int64)
    return index.filter(~index.is_in(copies.implode()))


def repair(
    bad: dict[Path, str], others: dict[Path, pl.Series]
) -> tuple[dict[Path, Path], dict[Path, Path]]:
    """Quarantine each bad file; one that holds copies besides rows no other file holds
    (``others``: their indices) leaves those rows in the store. Returns where each file went
    and the file that keeps a file's other rows."""
    moved, rest = {}, {}
    for path in bad:
        keep = others.get(path)
        moved[path], kept = quarantine(path, keep if keep is not None and keep.len() else None)
        if kept is not None:
            rest[path] = kept
    return moved, rest


def quarantine(path: Path, keep: pl.Series | None = None) -> tuple[Path, Path | None]:
    """Move ``path`` into its store's quarantine folder; a file of that name there already is
    an error (nothing is overwritten). The rows at indices ``keep`` stay in the store, in a new
    file named after it. Returns the quarantined path and that file."""
    folder = path.parent / QUARANTINE
    target = folder / path.name
    try:
        folder.mkdir(exist_ok=True)
        os.link(path, target)  # (fails where the target exists: no overwrite)
    except FileExistsError:
        raise TraceError(f"cannot quarantine {path}: {target} exists already") from None
    except OSError as exc:
        raise TraceError(f"cannot quarantine {path}: {exc.strerror or exc}") from None
    try:
        kept = None if keep is None else write_rest(path, keep)
    except BaseException:
        target.unlink()  # the second name only: the file stays in the store, as it was
        raise
    path.unlink()
    return target, kept


def write_rest(path: Path, keep: pl.Series) -> Path:
    """Write the rows of ``path`` at indices ``keep`` (its schema, metadata and extra columns
    kept) to a new file beside it, named to sort where it does; atomically, never over an
    existing file."""
    target = path.with_name(f"{path.stem}{REST_SUFFIX}{path.suffix}")
    tmp = path.with_name(f".tmp-{target.name}")
    try:
        table = pq.read_table(path).take(pa.array(keep.to_list(), pa.int64()))
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, target)
    except FileExistsError:
        raise TraceError(f"cannot keep the other rows of {path}: {target} exists") from None
    except (OSError, pa.ArrowException) as exc:
        raise TraceError(f"cannot keep the other rows of {path}: {first_line(exc)}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target
