"""A disk that fills up mid-run (the run directory's or the trace store's): the run stops at
once with one error, the checkpoint counts exactly the trace rows on disk, and a resumed run
continues after it with no iteration missing and none twice (:func:`launch.close_records`,
:meth:`Checkpointer.save`'s ``then``)."""

from __future__ import annotations

import pytest
from bdsgd.stages.engine.launch import run_engine
from bdsgd.stages.engine.resume import STATE_FILE
from bdsgd.stages.errors import CheckpointError, TraceError
from bdsgd.stages.store import TraceStore
from bdsgd.stages.train import load_state

from tests.full_disk import Disk
from tests.stages.engine.test_engine import RecordingStatic, engine_config

pytestmark = pytest.mark.timeout(300)

FILL_AT, ITERATIONS = 17, 30


@pytest.fixture
def disk(tmp_path, monkeypatch):
    d = Disk(tmp_path / "disk", monkeypatch)
    yield d
    d.unmount()


@pytest.mark.parametrize(("full", "error"), [("run", CheckpointError), ("traces", TraceError)])
def test_a_disk_filling_mid_run_loses_nothing_and_resumes(tmp_path, disk, full, error):
    run = disk.path / "run" if full == "run" else tmp_path / "run"
    traces = disk.path / "traces" if full == "traces" else tmp_path / "traces"
    cfg = engine_config(workers=2, hosts=("h0", "h1"), iterations=ITERATIONS, record_batch=5,
                        record_s=0.0, stragglers="none")  # fmt: skip

    def fill_at(t: int, row: dict) -> None:
        if t == FILL_AT:
            disk.fill()

    with pytest.raises(error, match="No space left on device"):
        run_engine(cfg, RecordingStatic(2), traces, fill_at, run)
    state = load_state(run)
    done = state["next_iteration"]
    assert 0 < done <= FILL_AT + 1 and state["log"]["iteration"] == list(range(done))
    rows = TraceStore(traces).read()
    cells = sorted(zip(rows["iteration"], rows["worker"], strict=True))
    assert cells == [(t, w) for t in range(done) for w in (0, 1)]  # what it counts, no more
    assert not [p for p in run.rglob(".tmp-*")] + [p for p in traces.rglob(".tmp-*")]

    disk.free()
    again = run_engine(cfg, RecordingStatic(2), traces, lambda t, r: None, run, resume=state)
    assert again.log["iteration"] == list(range(ITERATIONS))
    rows = TraceStore(traces).read()  # (validates: no cell twice)
    assert sorted(set(rows["iteration"])) == list(range(ITERATIONS))
    assert (run / STATE_FILE).is_file()
