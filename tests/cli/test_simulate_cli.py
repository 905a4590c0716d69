"""``bdsgd simulate`` through click: the JSON contract, the run directory and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from bdsgd.stages.fit import FitConfig, run_fit
from bdsgd.stages.store import RunMatrix, TraceStore, matrix_rows
from click.testing import CliRunner

from bdsgd_cli.main import cli


def write_run(path, run_id: str, runtimes: np.ndarray, host: str = "h") -> None:
    """One schema-v1 run of (T, N) run-times on hosts ``<host>0``, ``<host>1``, nothing
    censored."""
    mask = np.ones(runtimes.shape, dtype=bool)
    hosts = tuple(f"{host}{w % 2}" for w in range(runtimes.shape[1]))
    run = RunMatrix(run_id, runtimes, ~mask, mask, hosts)
    TraceStore(path).append(matrix_rows(run, source="profile"))


def straggling(rows: int, workers: int, seed: int = 0) -> np.ndarray:
    """Exponential-ish run-times plus one worker that is always 5x slower."""
    x = np.random.default_rng(seed).lognormal(np.log(0.05), 0.2, (rows, workers))
    x[:, -1] *= 5
    return x


def test_json_contract_is_the_last_stdout_line(tmp_path):
    write_run(tmp_path / "traces", "profile-1", straggling(40, 6))
    result = CliRunner().invoke(
        cli, ["simulate", "--traces", str(tmp_path / "traces"), "--json", "--seed", "1"]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["workers"] == 6 and payload["iterations"] == 40
    for name in ("full", "static:5", "elfving", "ecdf", "ewma", "async", "oracle"):
        metrics = payload["policies"][name]
        assert list(metrics)[:4] == ["throughput", "oracle_ratio", "mean_c", "decision_ms"]
    assert payload["policies"]["oracle"]["oracle_ratio"] == 1.0
    assert payload["policies"]["static:5"]["throughput"] > payload["policies"]["full"]["throughput"]
    assert payload["best"] != "oracle"


def test_policies_run_choice_from_frac_and_out(tmp_path):
    write_run(tmp_path / "traces", "profile-1", straggling(50, 4))
    write_run(tmp_path / "traces", "profile-2", straggling(20, 8))
    out = tmp_path / "sim"
    args = [
        "simulate",
        "--traces",
        str(tmp_path / "traces"),
        "--policies",
        "full, static:3,ewma",
        "--run",
        "profile-1",
        "--from-frac",
        "0.8",
        "--overhead-s",
        "0.01",
        "--out",
        str(out),
        "--json",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["workers"] == 4 and payload["iterations"] == 10
    assert set(payload["policies"]) == {"full", "static:3", "ewma"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "simulate" and summary["traces"] == str(tmp_path / "traces")
    assert (out / "iterations.parquet").is_file()
    again = CliRunner().invoke(cli, [*args[:4], "full", *args[5:]])  # an earlier simulate's
    assert again.exit_code == 0, again.output
    assert json.loads((out / "summary.json").read_text())["policies"].keys() == {"full"}


def test_out_interrupted_before_its_summary_may_be_written_again(tmp_path):
    """simulate writes iterations.parquet, then summary.json (the marker): a run stopped in
    between left a directory that is still simulate's."""
    write_run(tmp_path / "traces", "profile-1", straggling(10, 4))
    out = tmp_path / "sim"
    out.mkdir()
    (out / "iterations.parquet").write_bytes(b"partial run of ours")
    args = ["simulate", "--traces", str(tmp_path / "traces"), "--policies", "full"]
    result = CliRunner().invoke(cli, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "summary.json").read_text())["kind"] == "simulate"


@pytest.mark.parametrize("kind", ["train", None])
def test_out_that_holds_files_simulate_did_not_write_is_refused(tmp_path, kind):
    """A train run directory (or any other non-empty one) is never overwritten."""
    write_run(tmp_path / "traces", "profile-1", straggling(10, 4))
    out = tmp_path / "run"
    out.mkdir()
    files = {"summary.json": json.dumps({"kind": kind}), "iterations.parquet": "theirs"}
    for name, text in files.items():
        (out / name).write_text(text)
    args = ["simulate", "--traces", str(tmp_path / "traces"), "--policies", "full"]
    result = CliRunner().invoke(cli, [*args, "--out", str(out)])
    assert "not an earlier simulate's output" in one_line_error(result)
    assert {p.name: p.read_text() for p in out.iterdir()} == files


def one_line_error(result) -> str:
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_unknown_policy_is_a_one_line_error(tmp_path):
    write_run(tmp_path / "traces", "profile-1", straggling(10, 4))
    out = tmp_path / "sim"
    result = CliRunner().invoke(
        cli,
        [
            "simulate",
            "--traces",
            str(tmp_path / "traces"),
            "--policies",
            "full,warp",
            "--out",
            str(out),
        ],
    )
    assert "unknown policy 'warp'" in one_line_error(result)
    assert not out.exists()


def test_missing_traces_and_missing_checkpoint_are_one_line_errors(tmp_path):
    result = CliRunner().invoke(cli, ["simulate", "--traces", str(tmp_path / "none")])
    assert "does not exist" in one_line_error(result)
    result = CliRunner().invoke(cli, ["simulate"])
    assert "--traces" in one_line_error(result)
    write_run(tmp_path / "traces", "profile-1", straggling(10, 4))
    result = CliRunner().invoke(
        cli, ["simulate", "--traces", str(tmp_path / "traces"), "--policies", "bdsgd"]
    )
    assert "--checkpoint" in one_line_error(result)


@pytest.mark.slow
def test_bdsgd_end_to_end_with_a_fitted_checkpoint(tmp_path):
    traces, ckpt = tmp_path / "traces", tmp_path / "m.pt"
    write_run(traces, "profile-1", straggling(120, 6))
    fit = FitConfig(
        traces=traces,
        checkpoint=ckpt,
        steps=10,
        window=16,
        batch=4,
        eval_samples=16,
        progress=False,
    )
    run_fit(fit)
    replayed = CliRunner().invoke(
        cli,
        [
            "simulate",
            "--traces",
            str(traces),
            "--checkpoint",
            str(ckpt),
            "--from-frac",
            "0.5",
            "--policies",
            "bdsgd,full",
            "--json",
        ],
    )
    assert replayed.exit_code == 0, replayed.output
    policies = json.loads(replayed.stdout.strip().splitlines()[-1])["policies"]
    bdsgd, full = policies["bdsgd"], policies["full"]
    assert full["mean_c"] == 6 and bdsgd["decision_ms"] > 0
    assert bdsgd["mean_c"] < 5.5  # it learned to drop the worker that is always 5x slower
    assert bdsgd["throughput"] > 2 * full["throughput"]  # simulated seconds, not wall-clock
    sampled = CliRunner().invoke(
        cli,
        [
            "simulate",
            "--sample",
            "30",
            "--checkpoint",
            str(ckpt),
            "--policies",
            "bdsgd,static:5",
            "--json",
        ],
    )
    assert sampled.exit_code == 0, sampled.output
    payload = json.loads(sampled.stdout.strip().splitlines()[-1])
    assert payload["workers"] == 6 and payload["iterations"] == 30
    elsewhere = tmp_path / "elsewhere"  # the same shape, but none of the hosts fitted on
    write_run(elsewhere, "profile-2", straggling(40, 6), host="node")
    foreign = CliRunner().invoke(
        cli, ["simulate", "--traces", str(elsewhere), "--checkpoint", str(ckpt)]
    )
    assert "fitted on another cluster (hosts h0, h1" in one_line_error(foreign)


def test_objective_suffix_and_explore_flag(tmp_path):
    write_run(tmp_path / "traces", "profile-1", straggling(120, 4))
    args = ["simulate", "--traces", str(tmp_path / "traces"), "--json"]
    result = CliRunner().invoke(
        cli, [*args, "--policies", "ewma,ewma:iteration", "--explore", "0.5"]
    )
    assert result.exit_code == 0, result.output
    policies = json.loads(result.output.strip().splitlines()[-1])["policies"]
    assert set(policies) == {"ewma", "ewma:iteration"}
    bad = CliRunner().invoke(cli, [*args, "--explore", "2"])
    assert bad.exit_code != 0 and "--explore must be in [0, 1)" in one_line_error(bad)


def test_noise_scale_adds_goodput_and_ranks_by_it(tmp_path):
    write_run(tmp_path / "traces", "profile-1", straggling(80, 6))
    args = ["simulate", "--traces", str(tmp_path / "traces"), "--json"]
    result = CliRunner().invoke(
        cli, [*args, "--policies", "ewma,ewma:goodput,async", "--noise-scale", "4"]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["best_goodput"] == "ewma:goodput"
    good, plain = payload["policies"]["ewma:goodput"], payload["policies"]["ewma"]
    assert good["goodput"] > plain["goodput"] and good["mean_c"] < plain["mean_c"]
    assert "goodput" not in payload["policies"]["async"]
    bad = CliRunner().invoke(cli, [*args, "--noise-scale", "soon"])
    assert bad.exit_code != 0 and "neither a number" in one_line_error(bad)
    static = CliRunner().invoke(cli, [*args, "--policies", "static:3:goodput"])
    assert static.exit_code != 0 and "dynamic cutoff policies" in one_line_error(static)


def test_skip_bad_files_replays_the_good_runs(tmp_path):
    traces = tmp_path / "traces"
    write_run(traces, "profile-1", straggling(20, 4))
    bad = traces / "part-zz-broken.parquet"
    bad.write_bytes(b"garbage")
    args = ["simulate", "--traces", str(traces), "--policies", "full,static:3", "--json"]
    refused = CliRunner().invoke(cli, args)
    assert f"{bad}: not a readable Parquet file" in one_line_error(refused)
    replayed = CliRunner().invoke(cli, [*args, "--skip-bad-files"])
    assert replayed.exit_code == 0, replayed.stderr
    assert json.loads(replayed.stdout.strip().splitlines()[-1])["iterations"] == 20
    assert bad.read_bytes() == b"garbage"


def test_an_unwritable_out_is_refused_before_any_work(tmp_path):
    write_run(tmp_path / "traces", "profile-1", straggling(20, 4))
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "sim"
    result = CliRunner().invoke(
        cli, ["simulate", "--traces", str(tmp_path / "traces"), "--out", str(out)]
    )
    assert f"cannot write --out {out}: {tmp_path / 'file'} is not a directory" in one_line_error(
        result
    )
    assert "full" not in result.stderr  # no ranking: nothing was replayed


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_overhead_must_be_finite_and_not_negative(tmp_path, value):
    write_run(tmp_path / "traces", "profile-1", straggling(10, 4))
    result = CliRunner().invoke(
        cli, ["simulate", "--traces", str(tmp_path / "traces"), "--overhead-s", value]
    )
    assert "--overhead-s must be a finite number >= 0" in one_line_error(result)
