"""The run directory: what ``bdsgd train --out DIR`` and ``bdsgd simulate --out DIR`` write and
``bdsgd report`` reads.

    DIR/summary.json        {"kind": "train" | "simulate", "traces": PATH, "run_id": ...,
                             plus the command's JSON summary (SPEC), per policy for simulate}
    DIR/iterations.parquet  one row per (policy, iteration), columns below, written when the
                            run ends
    DIR/log/iterations-<k>.parquet
                            the same rows, a segment per checkpoint of a run under way: each
                            holds the rows since the one before, so a checkpoint writes its new
                            rows and not the whole log; the run's end folds them into
                            iterations.parquet

Nullable columns are null where they do not apply (no loss in simulate, no prediction for a policy
without a predictive distribution).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from bdsgd.stages.errors import BdsgdError, ConfigError

SUMMARY = "summary.json"
ITERATIONS = "iterations.parquet"
SEGMENTS = "log"  # a run under way: its iteration log in segments
RUN_DIR_VERSION = 1

ITERATION_COLUMNS: tuple[pa.Field, ...] = (
    pa.field("policy", pa.string(), nullable=False),
    pa.field("iteration", pa.int64(), nullable=False),
    pa.field("wall_s", pa.float64(), nullable=False),  # end of the iteration, since run start
    pa.field("iteration_s", pa.float64(), nullable=False),  # duration of the iteration
    pa.field("c", pa.int32(), nullable=False),  # gradients applied
    pa.field("workers", pa.int32(), nullable=False),  # live workers
    pa.field("decision_ms", pa.float64(), nullable=False),  # time to choose c
    pa.field("loss", pa.float64(), nullable=True),  # training loss of the applied gradients
    pa.field("eval_loss", pa.float64(), nullable=True),  # held-out loss, when evaluated
    pa.field("lr", pa.float64(), nullable=True),
    pa.field("staleness", pa.float64(), nullable=True),  # mean staleness of applied gradients
    pa.field("pred_q10", pa.float64(), nullable=True),  # predicted iteration time quantiles
    pa.field("pred_q50", pa.float64(), nullable=True),
    pa.field("pred_q90", pa.float64(), nullable=True),
    pa.field("noise_scale", pa.float64(), nullable=True),  # gradient noise scale B, samples
    pa.field("gain", pa.float64(), nullable=True),  # what the c gradients were worth: gain(c)
    pa.field("peer", pa.string(), nullable=True),  # self-checking bdsgd: the peer whose c it played
)
ITERATION_SCHEMA = pa.schema(ITERATION_COLUMNS, metadata={b"bdsgd.run_dir": b"1"})


def iterations_table(columns: dict[str, list]) -> pa.Table:
    """Build the iterations table; absent nullable columns are filled with nulls."""
    n = len(columns["iteration"])
    arrays = [pa.array(columns.get(f.name, [None] * n), type=f.type) for f in ITERATION_COLUMNS]
    return pa.Table.from_arrays(arrays, schema=ITERATION_SCHEMA)


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file under a temporary name and rename it into place; a failure leaves neither."""
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):  # (a full disk: no partial file is left)
            tmp.unlink(missing_ok=True)


def write_run_dir(out: Path, summary: dict, iterations: pa.Table | None) -> None:
    """Write a run directory's summary and its whole iteration log (``iterations`` None: the
    summary alone, the log being in segments), each atomically; the whole log replaces the
    segments."""
    out.mkdir(parents=True, exist_ok=True)
    if iterations is not None:
        sink = pa.BufferOutputStream()
        pq.write_table(iterations, sink)
        write_atomic(out / ITERATIONS, sink.getvalue().to_pybytes())
        for segment in segment_paths(out):
            segment.unlink(missing_ok=True)
    payload = {"run_dir_version": RUN_DIR_VERSION, **summary}
    write_atomic(out / SUMMARY, json.dumps(payload, indent=2, default=float).encode())


def check_output_dir(
    out: Path, marker: str, kind: str, writes: str, before_marker: tuple[str, ...] = ()
) -> None:
    """Raise a one-line error unless ``out`` can be written: its nearest existing ancestor is a
    writable directory, and an existing ``out`` is empty or an earlier ``kind`` output, whose
    files are replaced: no command overwrites a file it did not write. An earlier output has
    its ``marker`` JSON saying ``"kind": kind``, or holds only files the command writes
    ``before_marker`` (it was interrupted before the marker landed). ``writes`` names what it
    writes, for the message. Creates nothing."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"cannot write --out {out}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write --out {out}: {existing} is not writable")
    try:
        names = (
            {p.name for p in out.iterdir() if not p.name.startswith(".tmp-")}
            if existing == out
            else set()
        )
    except OSError as exc:  # (unreadable: what it holds cannot be checked)
        raise ConfigError(f"cannot read --out {out}: {exc.strerror or exc}") from None
    if names and not (names <= set(before_marker) or written_as(out / marker, kind)):
        raise ConfigError(
            f"--out {out} is not empty and not an earlier {kind}'s output: pass a new or empty "
            f"directory ({kind} writes {writes} there)"
        )


def written_as(marker: Path, kind: str) -> bool:
    """Whether the JSON file ``marker`` says its directory is a ``kind`` output."""
    try:
        return json.loads(marker.read_text()).get("kind") == kind
    except (OSError, ValueError, AttributeError):
        return False


def segment_paths(out: Path) -> list[Path]:
    """The iteration-log segments of a run under way, in the order they were written."""
    return sorted((Path(out) / SEGMENTS).glob("iterations-*.parquet"))


def write_segment(out: Path, rows: pa.Table) -> None:
    """Append ``rows`` to the run's iteration log as a segment of their own (atomically)."""
    folder = Path(out) / SEGMENTS
    folder.mkdir(parents=True, exist_ok=True)
    done = segment_paths(out)
    k = int(done[-1].stem.split("-")[1]) + 1 if done else 0
    sink = pa.BufferOutputStream()
    pq.write_table(rows, sink)
    write_atomic(folder / f"iterations-{k:06d}.parquet", sink.getvalue().to_pybytes())


def read_iterations(path: Path) -> pa.Table:
    """A run directory's iteration log: ``iterations.parquet`` and the segments written since,
    a later row of an iteration replacing an earlier one (a run resumed from a checkpoint
    writes again what it redoes)."""
    parts = [p for p in [Path(path) / ITERATIONS, *segment_paths(path)] if p.is_file()]
    if not parts:
        raise FileNotFoundError(f"{path} holds no {ITERATIONS}")
    tables = [pq.read_table(p) for p in parts]
    if len(tables) == 1:
        return tables[0]
    table = pa.concat_tables([t.select(ITERATION_SCHEMA.names) for t in tables])
    rows = table.to_pydict()
    last = {}
    for i, key in enumerate(zip(rows["policy"], rows["iteration"], strict=True)):
        last[key] = i
    keep = sorted(last.values())
    return table.take(pa.array(keep)).sort_by("iteration")


def read_run_dir(path: Path) -> tuple[dict, pa.Table]:
    """Read a run directory; a one-line BdsgdError if it is not one."""
    path = Path(path)
    if not (path / SUMMARY).is_file() or not ((path / ITERATIONS).is_file() or segment_paths(path)):
        raise BdsgdError(f"{path} is not a bdsgd run directory (needs {SUMMARY} and {ITERATIONS})")
    try:
        summary = json.loads((path / SUMMARY).read_text())
        table = read_iterations(path)
    except (ValueError, OSError, pa.ArrowException) as exc:
        raise BdsgdError(f"{path}: unreadable run directory ({str(exc).splitlines()[0]})") from None
    if table.num_rows == 0:
        raise BdsgdError(f"{path}: the run has no iterations")
    return summary, table
