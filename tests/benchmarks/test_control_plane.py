"""The control-plane benchmark's command: a few emulated ranks against a real store, one JSON
object as its last line with the contract's keys (no timings asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.processes import run_in_session

ROOT = Path(__file__).resolve().parents[2]
KEYS = (
    "ranks",
    "cut_visible_ms_p50",
    "cut_visible_ms_p99",
    "store_round_trips_per_iteration",
    "coordinator_cpu_ms_per_iteration",
)


def run_command(*args: str) -> dict:
    """``python -m benchmarks.control_plane ARGS --json`` in its own process group, reaped."""
    cmd = [sys.executable, "-m", "benchmarks.control_plane", *args, "--json"]
    done = run_in_session(cmd, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["direct", "batched", "fixed"])
def test_quick_json_has_the_contract_keys(mode):
    result = run_command("--ranks", "8", "--procs", "2", "--iterations", "4", "--mode", mode)
    assert all(key in result for key in KEYS)
    assert result["ranks"] == 8 and result["mode"] == mode and result["iterations"] == 2
    assert result["mean_c"] == 7.0  # static c = 90% of 8 (fixed: announced, cut by ticket 7)
    # every rank takes a ticket or sees the cut first; the admitted ones write a report
    assert result["store_round_trips_per_iteration"] >= 8 + 7
    # causal order: ticket c is taken, (its report read,) the cut set, then seen everywhere
    assert 0 < result["cut_set_ms_p50"] and 0 < result["cut_visible_ms_p50"]


@pytest.mark.parametrize("mode", ["batched", "fixed"])
def test_an_online_policy_runs_through_both_ways_of_cutting(mode):
    """``ewma:online`` revises c as the reports come; ``fixed`` moves the announced c after each
    revision, and the iteration still ends once, at a c of the ranks."""
    result = run_command("--ranks", "8", "--procs", "2", "--iterations", "5", "--mode", mode,
                         "--policy", "ewma:online")  # fmt: skip
    assert result["policy"] == "ewma:online" and result["iterations"] == 3
    assert 1 <= result["mean_c"] <= 8
    assert 0 < result["cut_set_ms_p50"] and 0 < result["cut_visible_ms_p50"]
