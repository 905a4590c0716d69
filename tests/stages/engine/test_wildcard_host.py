"""``--host 0.0.0.0``: the control store listens on every interface, the workers reach it on
loopback and gloo binds loopback (it cannot bind a wildcard), on both sync engines."""

from __future__ import annotations

import pytest
from bdsgd.stages.engine.launch import advertised_host, run_engine
from bdsgd.stages.store import TraceStore

from tests.stages.engine.test_engine import RecordingStatic, engine_config

pytestmark = pytest.mark.timeout(300)


def test_a_wildcard_is_advertised_as_loopback():
    assert advertised_host("0.0.0.0") == "127.0.0.1" and advertised_host("::") == "::1"
    assert advertised_host("10.1.2.3") == "10.1.2.3"


@pytest.mark.parametrize("engine", ["ps", "collective"])
def test_a_run_on_every_interface_runs(tmp_path, engine):
    cfg = engine_config(workers=2, hosts=("h0", "h1"), iterations=6, engine=engine,
                        host="0.0.0.0", stragglers="none")  # fmt: skip
    result = run_engine(cfg, RecordingStatic(2), tmp_path / "traces", lambda t, r: None)
    assert result.log["iteration"] == list(range(6)) and result.dead_workers == {}
    assert TraceStore(tmp_path / "traces").read().height == 12
