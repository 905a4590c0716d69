"""When the trace rows and the checkpoint are written (:meth:`Engine.record_due`): after every
``record_batch``-th iteration, at most once per ``record_s`` seconds, and always at the end; the
trace writer's cap on the rows it holds."""

from __future__ import annotations

import pytest
from bdsgd.stages.engine import launch
from bdsgd.stages.engine.launch import run_engine
from bdsgd.stages.engine.protocol import replica_key
from bdsgd.stages.engine.resume import STATE_FILE
from bdsgd.stages.store import TraceStore
from bdsgd.stages.train import load_state

from tests.stages.engine.test_collective import replica_params
from tests.stages.engine.test_engine import RecordingStatic, engine_config

pytestmark = pytest.mark.timeout(240)

ITERATIONS, BATCH, WORKERS = 20, 5, 2


def run(tmp_path, engine: str, record_s: float, run_dir: bool = True):
    cfg = engine_config(engine=engine, workers=WORKERS, hosts=("h0", "h1"), iterations=ITERATIONS,
                        record_batch=BATCH, record_s=record_s, stragglers="none")  # fmt: skip
    out = tmp_path / "run" if run_dir else None
    return run_engine(cfg, RecordingStatic(WORKERS), tmp_path / "traces", lambda t, r: None, out)


@pytest.mark.parametrize("engine", ["ps", "collective"])
def test_without_a_time_floor_every_record_batch_writes_a_trace_file(tmp_path, engine):
    result = run(tmp_path, engine, record_s=0.0)
    assert len(result.trace_files) == ITERATIONS // BATCH
    assert TraceStore(tmp_path / "traces").read().height == ITERATIONS * WORKERS


@pytest.mark.parametrize("engine", ["ps", "collective"])
def test_a_time_floor_longer_than_the_run_writes_one_file_and_the_final_checkpoint(
    tmp_path, engine
):
    result = run(tmp_path, engine, record_s=1e6)
    assert len(result.trace_files) == 1  # at the end: nothing was due before it
    rows = TraceStore(tmp_path / "traces").read()
    assert rows.height == ITERATIONS * WORKERS
    state = load_state(tmp_path / "run")
    assert state["next_iteration"] == ITERATIONS
    assert state["log"]["iteration"] == list(range(ITERATIONS))
    if engine == "collective":  # the replica's state is the one after the last iteration
        assert replica_params(tmp_path / "run")[1] == ITERATIONS


def test_the_writer_writes_a_file_of_its_own_once_it_holds_its_cap_of_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "MAX_PENDING_ROWS", 4 * WORKERS)  # a file per 4 iterations
    result = run(tmp_path, "ps", record_s=1e6, run_dir=False)
    assert len(result.trace_files) == ITERATIONS // 4
    assert TraceStore(tmp_path / "traces").read().height == ITERATIONS * WORKERS
    assert not (tmp_path / "run" / STATE_FILE).exists()


def test_each_collective_checkpoint_holds_the_replica_state_of_its_iteration(tmp_path):
    """record_s 0: a checkpoint after every 5th iteration, each with the lowest replica's
    state after exactly those iterations (the replica publishes it where the coordinator
    decided, before it announced them). Read from the callback, which runs before the next."""
    seen: dict[int, tuple[int, int]] = {}

    def on_iteration(t: int, row: dict) -> None:
        if (t + 1) % BATCH == 0 and (tmp_path / "run" / STATE_FILE).exists():
            seen[t] = (load_state(tmp_path / "run")["next_iteration"],
                       replica_params(tmp_path / "run")[1])  # fmt: skip

    cfg = engine_config(engine="collective", workers=WORKERS, hosts=("h0", "h1"),
                        iterations=ITERATIONS, record_batch=BATCH, record_s=0.0,
                        stragglers="none")  # fmt: skip
    run_engine(cfg, RecordingStatic(WORKERS), tmp_path / "traces", on_iteration, tmp_path / "run")
    assert seen == {9: (5, 5), 14: (10, 10), 19: (15, 15)}


def test_the_lowest_replica_publishes_no_state_where_no_checkpoint_was_decided(
    tmp_path, monkeypatch
):
    """A floor longer than the run: no checkpoint before the end, so no replica state in the
    store at any boundary (each is the whole model; published and never taken, they would pile
    up), read from the run's own store in the callback."""
    stores = []
    real = launch.P.open_store
    monkeypatch.setattr(
        launch.P, "open_store", lambda *a, **k: stores.append(real(*a, **k)) or stores[-1]
    )
    published = []

    def on_iteration(t: int, row: dict) -> None:
        published.extend(k for k in (5, 10, 15) if k <= t and stores[0].check([replica_key(k)]))

    cfg = engine_config(engine="collective", workers=WORKERS, hosts=("h0", "h1"),
                        iterations=ITERATIONS, record_batch=BATCH, record_s=1e6,
                        stragglers="none")  # fmt: skip
    run_engine(cfg, RecordingStatic(WORKERS), tmp_path / "traces", on_iteration, tmp_path / "run")
    assert published == []
    assert replica_params(tmp_path / "run")[1] == ITERATIONS  # the final state still came
