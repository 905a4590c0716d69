"""``bdsgd train --policy bdsgd`` says whether it leaned on a simple peer (run-dir summary)."""

from __future__ import annotations

import json

import numpy as np

from tests.cli.test_profile_cli import bdsgd
from tests.stages.engine import write_replay_trace


def test_train_with_bdsgd_reports_its_self_check(tmp_path):
    # one worker per host, independent heavy tails: fit a checkpoint on the replayed trace, then
    # train against it; the run directory's summary says how often bdsgd played a peer's c
    rng = np.random.default_rng(0)
    runtimes = np.exp(np.log(0.004) + 0.8 * rng.standard_normal((40, 4))).round(5).tolist()
    replay = write_replay_trace(tmp_path / "replay", runtimes)
    fitted = bdsgd(
        "fit", "--traces", str(replay), "--checkpoint", str(tmp_path / "m.pt"),
        "--steps", "5", "--window", "12", "--batch", "2", "--no-progress",
    )  # fmt: skip
    assert fitted.returncode == 0, fitted.stderr
    done = bdsgd(
        "train", "--workers", "4", "--iterations", "12", "--policy", "bdsgd",
        "--checkpoint", str(tmp_path / "m.pt"), "--traces", str(tmp_path / "traces"),
        "--out", str(tmp_path / "run"), "--stragglers", f"replay:{replay}",
        "--batch-size", "16", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    check = summary["self_check"]
    assert check["decided"] == 12 and 0 <= check["leaned"] <= 12
    assert set(check["rates"]) == {"bdsgd", "ewma", "ecdf"}
    assert ("leaned on a simple peer" in done.stderr) == (check["leaned"] > 0)
