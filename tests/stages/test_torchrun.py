"""``bdsgd train`` under torchrun: every rank trains a synchronous policy (the library's loop);
rank 0 runs the parameter server of an asynchronous one. The control store is torchrun's. Tried on
one machine as two "nodes" of two processes each."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import polars as pl
import pytest
from bdsgd.stages.engine.launch import check_world
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.store import TraceStore
from bdsgd.stages.wire.torchrun import Torchrun

from tests.processes import run_in_sessions

TORCHRUN = Path(sys.executable).with_name("torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def failed_nodes(nodes) -> str:
    """Each failing node's exit status and stderr (the end of a long one): torchrun's own
    report of a failed rank is long, and the rank's error comes before it."""
    return "\n".join(f"--- node {i} exited {n.returncode}:\n{n.stderr[-12000:]}"
                     for i, n in enumerate(nodes) if n.returncode != 0)  # fmt: skip


def test_from_env_reads_torchrun_variables(monkeypatch):
    for k, v in dict(
        RANK="2",
        WORLD_SIZE="4",
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT="29500",
        TORCHELASTIC_USE_AGENT_STORE="True",
    ).items():
        monkeypatch.setenv(k, v)
    tr = Torchrun.from_env()
    assert tr == Torchrun(2, 4, "10.0.0.1", 29500, True)
    with pytest.raises(ConfigError, match="world size minus one"):
        check_world(tr, workers=4)  # (rank 0 runs the parameter server)


def test_no_torchrun_without_its_variables(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert Torchrun.from_env() is None


def two_nodes(tmp_path, workers: int, policy: str) -> list:
    """``bdsgd train`` under two torchrun agents of two ranks each, on loopback."""
    cmd = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "test", "-m",
           "bdsgd_cli", "train", "--workers", str(workers), "--iterations", "20", "--policy",
           policy, "--traces", str(tmp_path / "traces"), "--out", str(tmp_path / "run"),
           "--stragglers", "synthetic:base_s=0.005", "--timeout", "60", "--json"]  # fmt: skip
    nodes = run_in_sessions([cmd, cmd], timeout=300)  # each torchrun and every rank it started
    assert [n.returncode for n in nodes] == [0, 0], failed_nodes(nodes)
    lines = [line for n in nodes for line in n.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints the summary
    return json.loads(lines[0])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to python")
def test_train_under_torchrun_two_nodes_trains_on_every_rank(tmp_path):
    """Four ranks on two "machines": every rank trains under static:2, the cut ranks' rows
    censored unless they finished their batch after the cut (then exact)."""
    summary = two_nodes(tmp_path, 4, "static:2")
    assert summary["iterations"] == 20
    c = pl.read_parquet(tmp_path / "run" / "iterations.parquet").sort("iteration")["c"]
    assert all(k >= 2 for k in c)  # static:2 (a ticket taken before the close is admitted too)
    rows = TraceStore(tmp_path / "traces").read()
    assert rows.height == 20 * 4 and set(rows["world_size"].to_list()) == {4}
    censored = rows.group_by("iteration").agg(pl.col("censored").sum()).sort("iteration")
    assert all(0 <= n <= 4 - k for n, k in zip(censored["censored"], c, strict=True))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed next to python")
def test_an_asynchronous_policy_under_torchrun_runs_its_server_on_rank_0(tmp_path):
    summary = two_nodes(tmp_path, 3, "k-async:2")
    assert summary["iterations"] == 20 and summary["mean_c"] == 2.0
    rows = TraceStore(tmp_path / "traces").read()
    assert set(rows["world_size"].to_list()) == {3} and set(rows["worker"]) == {0, 1, 2}
