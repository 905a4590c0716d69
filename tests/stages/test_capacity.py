"""How many workers this machine runs: the limit by cores and by memory, the override, and
reading the available memory."""

from __future__ import annotations

import pytest
from bdsgd.stages.capacity import (
    WORKER_BYTES,
    WORKERS_PER_CORE,
    Machine,
    available_memory,
    check_capacity,
)
from bdsgd.stages.errors import ConfigError


def test_cores_bound_the_workers_when_memory_is_plenty():
    machine = Machine(cores=2, available_bytes=10**15)
    assert machine.max_workers() == 2 * WORKERS_PER_CORE
    check_capacity(2 * WORKERS_PER_CORE, False, machine)
    with pytest.raises(ConfigError, match=r"--workers 17 .*2 cores.*--allow-oversubscribe"):
        check_capacity(2 * WORKERS_PER_CORE + 1, False, machine)


def test_memory_bounds_the_workers_when_it_is_short():
    machine = Machine(cores=64, available_bytes=5 * WORKER_BYTES + 1)
    assert machine.max_workers() == 5
    with pytest.raises(ConfigError, match="GiB available: at most 5 workers"):
        check_capacity(6, False, machine)


def test_the_override_lets_any_count_through():
    check_capacity(10_000, True, Machine(cores=1, available_bytes=0))


def test_this_machine_runs_at_least_one_worker():
    assert Machine.this().max_workers() >= 1
    with pytest.raises(ConfigError, match="allow-oversubscribe"):
        check_capacity(10_000, False)


def test_available_memory_takes_the_smaller_of_meminfo_and_the_cgroup(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 900 kB\nMemAvailable: 800 kB\n")
    assert available_memory(tmp_path) == 800 * 1024
    cgroup = tmp_path / "sys" / "fs" / "cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text("500000\n")
    (cgroup / "memory.current").write_text("100000\n")
    assert available_memory(tmp_path) == 400_000
    (cgroup / "memory.max").write_text("max\n")
    assert available_memory(tmp_path) == 800 * 1024


def test_unknown_memory_leaves_the_cores_to_decide(tmp_path):
    assert available_memory(tmp_path) is None
    assert Machine(cores=3, available_bytes=None).max_workers() == 3 * WORKERS_PER_CORE
