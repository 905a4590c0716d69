"""The store keys of iterations long past are deleted (:class:`KeyJanitor`), on a real TCPStore
alone and inside real engine runs, without losing an iteration."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from bdsgd.stages.engine import launch
from bdsgd.stages.engine.launch import run_engine
from bdsgd.stages.policies.asynchronous import KAsync
from bdsgd.stages.wire import janitor as J
from bdsgd.stages.wire import keys as P
from bdsgd.stages.wire.janitor import KeyJanitor

from tests.stages.engine import engine_config

pytestmark = pytest.mark.timeout(240)


def local_store() -> dist.TCPStore:
    return P.open_store("127.0.0.1", 0, True, 20.0)


def wait_gone(store: dist.Store, keys: list[str], timeout_s: float = 20.0) -> list[str]:
    """The keys still there once all are gone or ``timeout_s`` passed (deletion is async)."""
    deadline = time.monotonic() + timeout_s
    while (left := [k for k in keys if store.check([k])]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def test_the_janitor_keeps_the_last_iterations_and_deletes_the_older_ones():
    store = local_store()
    iterations = [[f"a/{t}", f"b/{t}"] for t in range(10)]
    for keys in iterations:
        for key in keys:
            store.set(key, "x")
    janitor = KeyJanitor(store, high_water=3)
    for keys in iterations:
        janitor.retire(keys)
    old = [k for keys in iterations[:7] for k in keys]
    assert wait_gone(store, old) == []
    janitor.close()
    assert janitor.deleted == len(old)
    assert all(store.check([k]) for keys in iterations[7:] for k in keys)


def test_a_run_shorter_than_the_high_water_mark_deletes_nothing():
    store = local_store()
    store.set("a/0", "x")
    janitor = KeyJanitor(store, high_water=3)
    for t in range(3):
        janitor.retire([f"a/{t}"])
    janitor.close()
    assert janitor.thread is None and janitor.deleted == 0 and store.check(["a/0"])


@pytest.fixture
def captured_store(monkeypatch):
    """The control store the engine run opens (the test checks its keys during the run), and a
    high-water mark of 4 iterations."""
    monkeypatch.setattr(J, "HIGH_WATER", 4)
    box: list[dist.Store] = []
    real = launch.P.open_store

    def open_store(*args, **kwargs):
        box.append(real(*args, **kwargs))
        return box[-1]

    monkeypatch.setattr(launch.P, "open_store", open_store)
    return box


def test_an_asynchronous_run_deletes_the_arrival_keys_of_long_past_updates(
    tmp_path, captured_store
):
    """k-async:2 takes at least 2 arrivals per update: at the last of 24 updates, the reports
    of the first 20 arrivals are gone and every update is logged."""
    cfg = engine_config(iterations=24, workers=3, hosts=("h0", "h1", "h2"))
    seen: dict[str, list[str]] = {}

    def on_iteration(t: int, row: dict) -> None:
        if t == cfg.iterations - 1:
            seen["left"] = wait_gone(
                captured_store[0], [P.async_arrival_key(k) for k in range(1, 21)]
            )

    result = run_engine(cfg, KAsync(2), tmp_path / "traces", on_iteration)
    assert result.log["iteration"] == list(range(cfg.iterations))
    assert seen["left"] == []
