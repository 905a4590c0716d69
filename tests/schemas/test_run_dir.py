"""The run directory's iteration log: whole at the end, in segments while a run is under way."""

from __future__ import annotations

import json

from bdsgd.schemas.run_dir import (
    ITERATIONS,
    iterations_table,
    read_run_dir,
    segment_paths,
    write_run_dir,
    write_segment,
)


def rows(first: int, last: int, loss: float = 1.0) -> dict:
    its = list(range(first, last))
    return {"policy": ["p"] * len(its), "iteration": its, "wall_s": [float(t) for t in its],
            "iteration_s": [1.0] * len(its), "c": [2] * len(its), "workers": [3] * len(its),
            "decision_ms": [0.1] * len(its), "loss": [loss] * len(its)}  # fmt: skip


def test_each_segment_holds_only_its_new_rows_and_the_log_reads_whole(tmp_path):
    write_segment(tmp_path, iterations_table(rows(0, 25)))
    write_segment(tmp_path, iterations_table(rows(25, 50)))
    write_run_dir(tmp_path, {"kind": "train", "run_id": "r"}, None)
    assert [len(p.read_bytes()) > 0 for p in segment_paths(tmp_path)] == [True, True]
    assert not (tmp_path / ITERATIONS).exists()
    summary, table = read_run_dir(tmp_path)
    assert summary["run_id"] == "r" and table["iteration"].to_pylist() == list(range(50))


def test_a_later_row_of_an_iteration_replaces_the_earlier_one(tmp_path):
    """A run resumed from its checkpoint at 20 redoes 20-24: their later rows are read."""
    write_segment(tmp_path, iterations_table(rows(0, 25, loss=1.0)))
    write_segment(tmp_path, iterations_table(rows(20, 30, loss=2.0)))
    (tmp_path / "summary.json").write_text(json.dumps({"kind": "train"}))
    _, table = read_run_dir(tmp_path)
    log = table.to_pydict()
    assert log["iteration"] == list(range(30))
    assert log["loss"] == [1.0] * 20 + [2.0] * 10


def test_the_whole_log_at_the_end_replaces_the_segments(tmp_path):
    write_segment(tmp_path, iterations_table(rows(0, 25)))
    write_run_dir(tmp_path, {"kind": "train"}, iterations_table(rows(0, 40)))
    assert segment_paths(tmp_path) == []
    assert read_run_dir(tmp_path)[1]["iteration"].to_pylist() == list(range(40))
