"""The trace writer after a failed append: it says so at once (no wait for ``timeout``), writes
nothing after the failure (no gap in the traces), and ``abandon`` drops what no checkpoint
counts."""

from __future__ import annotations

import pytest
from bdsgd.stages.errors import TraceError
from bdsgd.stages.store import TraceStore, TraceWriter

from tests.conftest import make_trace_rows

pytestmark = pytest.mark.timeout(60)  # a writer waiting out its 3600 s timeout fails the test


def failing_store(tmp_path, fail_on: int) -> TraceStore:
    """A store whose ``fail_on``-th append (1-based) fails as a full disk does."""
    store = TraceStore(tmp_path / "traces")
    append, calls = store.append, [0]

    def append_or_fail(table):
        calls[0] += 1
        if calls[0] == fail_on:
            raise TraceError(f"cannot write to trace store {store.path}: No space left on device")
        return append(table)

    store.append = append_or_fail
    return store


def batch(t: int) -> dict:
    rows = make_trace_rows(iterations=t + 1, workers=2)
    return {k: v[2 * t :] for k, v in rows.items()}  # iteration t's two rows


def test_a_failed_append_is_raised_at_once_and_nothing_after_it_is_written(tmp_path):
    writer = TraceWriter(failing_store(tmp_path, fail_on=2), batch_rows=2)
    writer.add(batch(0))
    writer.wait_written(2, timeout=3600)
    writer.add(batch(1))  # fails on disk
    with pytest.raises(TraceError, match="No space left on device"):
        writer.wait_written(4, timeout=3600)
    with pytest.raises(TraceError, match="writing traces failed"):
        writer.add(batch(2))
    writer.flush()
    with pytest.raises(TraceError):
        writer.close()
    assert sorted(TraceStore(tmp_path / "traces").read()["iteration"].unique()) == [0]


def test_abandon_writes_nothing_pending(tmp_path):
    writer = TraceWriter(TraceStore(tmp_path / "traces"), batch_rows=100)
    writer.add(batch(0))
    writer.abandon()
    assert writer.rows_written == 0 and not TraceStore(tmp_path / "traces").files()
