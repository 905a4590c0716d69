"""bdsgd.Cutoff's life outside the happy path: resume on ranks that see different checkpoints,
an error inside an iteration, calls after close(). Real ranks over gloo on loopback
(run_lifecycle.py), each test's processes reaped (launch.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.stages.loop.launch import run_ranks

SCRIPT = Path(__file__).with_name("run_lifecycle.py")


def run(tmp_path: Path, scenario: str) -> list[dict]:
    results = run_ranks(2, "--scenario", scenario, "--work", str(tmp_path / "work"),
                        "--result", str(tmp_path / "r"), script=SCRIPT)  # fmt: skip
    for rc, out in results:
        assert rc == 0, out[-2000:]
    return [json.loads((tmp_path / "r" / f"rank{r}.json").read_text()) for r in range(2)]


def closed_calls_refused(seen: dict) -> None:
    """A second close() returns None at once; iteration(), save() and step() after it raise."""
    assert seen["close_again"] == "ok None"
    for call in ("iteration_after_close", "save_after_close", "step_after_close"):
        assert seen[call] == "BdsgdError: this Cutoff is closed", call


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_refuses_a_checkpoint_not_every_rank_sees(tmp_path):
    """Rank 0 finds the checkpoint at iteration 2 and rank 1 none (no shared filesystem): both
    raise the same one line naming what each found, rather than training apart; a directory
    is refused; the same file on both ranks resumes both at 2."""
    seen = run(tmp_path, "resume")
    for s in seen:
        assert s["split"].startswith("CheckpointError: ") and "\n" not in s["split"]
        assert "rank 0: iteration 2" in s["split"] and "rank 1: none" in s["split"]
        assert "every rank must read the same checkpoint" in s["split"]
        assert s["directory"].startswith("CheckpointError: ") and "not a file" in s["directory"]
        assert s["same"] == "ok 2"
        assert s["close"] == ("ok 'summary'" if s is seen[0] else "ok None")
        closed_calls_refused(s)
    assert seen[0]["split"] == seen[1]["split"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_error_inside_an_iteration_breaks_the_cutoff_and_close_still_ends_it(tmp_path):
    """The loop catches an OOM raised inside iteration 1: iteration(), save() and step() then
    raise at once, naming it, and close() ends the job without waiting out timeout_s (an hour:
    a wait fails the test by its timeout)."""
    seen = run(tmp_path, "broken")
    for s in seen:
        for call in ("iteration", "save", "step"):
            assert s[call] == ("BdsgdError: iteration 1 ended in OutOfMemoryError: this Cutoff "
                               "cannot continue; restart the job and resume from its last "
                               "checkpoint (cut.resume)"), call  # fmt: skip
        assert s["close"].startswith("ok ")
        closed_calls_refused(s)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_error_as_an_iteration_ends_breaks_the_cutoff_too(tmp_path):
    """The loop leaves its micro-batches before it.backward: bdsgd's error as the iteration
    ends (no all-reduce) breaks the Cutoff as an error inside it does, naming it."""
    for s in run(tmp_path, "unbacked"):
        assert s["ended"].startswith("BdsgdError: a micro-batch ended without it.backward")
        assert s["iteration"].startswith("BdsgdError: iteration 1 ended in BdsgdError: this "
                                         "Cutoff cannot continue")  # fmt: skip
        assert s["close"].startswith("ok ")
        closed_calls_refused(s)
