"""``bdsgd fit``: end to end on a tiny trace store, --json contract, one-line errors."""

from __future__ import annotations

import dataclasses
import json

import torch
from click.testing import CliRunner

from bdsgd_cli.main import cli
from tests.stages.model.clusters import tiny_store

FAST = ["--steps", "5", "--window", "12", "--batch", "2", "--no-progress"]


def _invoke(*args: str):
    return CliRunner().invoke(cli, ["fit", *args])


def test_fit_trains_saves_and_prints_the_spec_json(tmp_path):
    store = tiny_store(tmp_path / "traces")
    ckpt = tmp_path / "model.pt"
    result = _invoke("--traces", str(store.path), "--checkpoint", str(ckpt), *FAST, "--json")
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["steps"] == 5 and isinstance(payload["val_nll"], float)
    assert set(payload["baseline_nll"]) == {"window", "ewma"}
    calibration = payload["calibration"]
    assert calibration["central"] == 0.9 and calibration["runtime"]["count"] > 0
    assert 0.0 <= calibration["runtime"]["coverage"] <= 1.0
    assert "90% predictive interval" in result.stderr
    ks = calibration["runtime"]["ks"]
    assert f"held-out PIT KS (0: the predictive's shape fits): run-times {ks:.3f}" in " ".join(
        result.stderr.split()
    )
    assert payload["model"] == {"host_drops": False, "host_regime": False}
    assert payload["auto_host"] is None  # a tiny store scores too few iterations to refit
    assert payload["checkpoint"] == str(ckpt)
    assert "ewma" in result.stderr
    assert torch.load(ckpt, weights_only=True)["summary"]["val_nll"] == payload["val_nll"]


def test_init_continues_from_a_checkpoint(tmp_path):
    store = tiny_store(tmp_path / "traces")
    first, second = tmp_path / "a.pt", tmp_path / "b.pt"
    assert _invoke("--traces", str(store.path), "--checkpoint", str(first), *FAST).exit_code == 0
    # a learning rate too small to move anything: what the second fit saves is where it began
    tiny = [*FAST, "--lr", "1e-12"]
    result = _invoke(
        "--traces", str(store.path), "--checkpoint", str(second), "--init", str(first), *tiny
    )
    assert result.exit_code == 0, result.stderr
    fresh = tmp_path / "fresh.pt"
    assert _invoke("--traces", str(store.path), "--checkpoint", str(fresh), *tiny).exit_code == 0
    weights = {p: torch.load(p, weights_only=True)["state_dict"] for p in (first, second, fresh)}
    assert weights[second].keys() == weights[first].keys()
    for name, value in weights[first].items():  # began at the first fit's weights ...
        torch.testing.assert_close(weights[second][name], value, rtol=0, atol=1e-6)
    moved = [n for n, v in weights[first].items() if not torch.allclose(weights[fresh][n], v)]
    assert moved  # ... which are not where a fit without --init begins
    assert torch.load(second, weights_only=True)["fit_config"]["init"] == str(first)


def test_empty_store_is_a_one_line_error(tmp_path):
    (tmp_path / "traces").mkdir()
    result = _invoke("--traces", str(tmp_path / "traces"), "--checkpoint", str(tmp_path / "m.pt"))
    assert result.exit_code != 0
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error:")
    assert not (tmp_path / "m.pt").exists()


def test_corrupt_init_checkpoint_is_a_one_line_error(tmp_path):
    store = tiny_store(tmp_path / "traces")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x80\x02garbage")
    result = _invoke(
        "--traces", str(store.path), "--checkpoint", str(tmp_path / "m.pt"), "--init", str(bad)
    )
    assert result.exit_code != 0 and "not a readable checkpoint" in result.stderr
    assert result.stderr.strip().count("\n") == 0


def test_missing_init_checkpoint_is_a_one_line_error(tmp_path):
    store = tiny_store(tmp_path / "traces")
    result = _invoke(
        "--traces",
        str(store.path),
        "--checkpoint",
        str(tmp_path / "m.pt"),
        "--init",
        str(tmp_path / "none.pt"),
    )
    assert result.exit_code != 0 and result.stderr.startswith("error: no checkpoint at")


def test_bad_option_value_is_a_one_line_error(tmp_path):
    store = tiny_store(tmp_path / "traces")
    result = _invoke(
        "--traces", str(store.path), "--checkpoint", str(tmp_path / "m.pt"), "--steps", "0"
    )
    assert result.exit_code != 0 and result.stderr.strip() == "error: fit: steps must be >= 1"


def test_cli_defaults_are_the_stage_config_defaults():
    from bdsgd.stages.fit import FitConfig

    from bdsgd_cli.fit import fit

    fields = {
        f.name: f.default
        for f in dataclasses.fields(FitConfig)
        if f.default is not dataclasses.MISSING
    }
    shared = {  # (through the option's type: --steps auto is FitConfig.steps None)
        p.name: p.type.convert(p.default, p, None)
        for p in fit.params
        if p.name in fields and p.default is not None
    }
    assert "steps" in shared and "early_stop" in shared
    for name, default in shared.items():
        assert default == fields[name], name


def test_a_bad_file_in_the_store_is_named_and_skip_bad_files_leaves_it_out(tmp_path):
    store = tiny_store(tmp_path / "traces")
    bad = store.path / "part-zz-broken.parquet"
    bad.write_bytes(b"PAR1 and then nothing")
    args = ["--traces", str(store.path), "--checkpoint", str(tmp_path / "m.pt"), *FAST]
    refused = _invoke(*args)
    assert refused.exit_code != 0 and not (tmp_path / "m.pt").exists()
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{bad}: not a readable Parquet file" in lines[0]
    assert "--skip-bad-files" in lines[0]
    skipped = _invoke(*args, "--skip-bad-files")
    assert skipped.exit_code == 0, skipped.stderr
    assert "skipping a bad trace file" in skipped.stderr and bad.name in skipped.stderr
    assert (tmp_path / "m.pt").is_file()
    assert bad.read_bytes() == b"PAR1 and then nothing"  # never modified


def _one_line_error(result, text: str) -> None:
    assert result.exit_code != 0 and result.stderr.startswith("error:"), result.stderr
    assert result.stderr.strip().count("\n") == 0 and text in result.stderr


def test_an_existing_file_that_is_not_a_checkpoint_is_never_overwritten(tmp_path):
    store = tiny_store(tmp_path / "traces")
    precious = tmp_path / "precious.txt"
    precious.write_text("my notes")
    result = _invoke("--traces", str(store.path), "--checkpoint", str(precious), *FAST)
    _one_line_error(result, "is not a bdsgd checkpoint")
    assert precious.read_text() == "my notes"


def test_a_checkpoint_inside_the_trace_store_is_refused_and_the_store_stays_readable(tmp_path):
    store = tiny_store(tmp_path / "traces")
    part = sorted(store.path.glob("*.parquet"))[0]
    before, rows = part.read_bytes(), store.read().height
    result = _invoke("--traces", str(store.path), "--checkpoint", str(part), *FAST)
    _one_line_error(result, "inside the trace store")
    assert part.read_bytes() == before and store.read().height == rows


def test_fitting_again_over_an_earlier_checkpoint_replaces_it(tmp_path):
    store = tiny_store(tmp_path / "traces")
    ckpt = tmp_path / "model.pt"
    for seed in ("1", "2"):
        result = _invoke(
            "--traces", str(store.path), "--checkpoint", str(ckpt), *FAST, "--seed", seed
        )
        assert result.exit_code == 0, result.stderr
    assert torch.load(ckpt, weights_only=True)["fit_config"]["seed"] == 2
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_crafted_init_checkpoint_is_a_one_line_error(tmp_path):
    store = tiny_store(tmp_path / "traces")
    first = tmp_path / "a.pt"
    assert _invoke("--traces", str(store.path), "--checkpoint", str(first), *FAST).exit_code == 0
    payload = torch.load(first, weights_only=True)
    payload["norm"]["scale"] = -1.0
    torch.save(payload, tmp_path / "bad.pt")
    out = tmp_path / "b.pt"
    args = [
        "--traces",
        str(store.path),
        "--checkpoint",
        str(out),
        "--init",
        str(tmp_path / "bad.pt"),
    ]
    _one_line_error(_invoke(*args, *FAST), "malformed checkpoint (norm scale -1.0")
    assert not out.exists()


def test_the_cli_s_auto_host_bound_is_the_stage_s():
    from bdsgd.stages.fit import AUTO_HOST_KS, FitConfig

    from bdsgd_cli import fit

    assert fit.AUTO_HOST_KS == AUTO_HOST_KS == FitConfig.auto_host_ks


def test_ks_above_the_bound_and_beyond_chance_is_flagged_and_none_is_left_out():
    from bdsgd_cli.fit import _ks_line

    line = _ks_line({"runtime": {"ks": 0.106, "ks_p95": 0.017}, "order_stat": {"ks": 0.04}})
    assert "run-times 0.106 [yellow](off)[/]" in line and line.endswith("x_(c) 0.040")
    few = _ks_line({"runtime": {"ks": 0.106, "ks_p95": 0.12}})  # within chance over few values
    assert few.endswith("run-times 0.106")
    assert _ks_line(None) is None and _ks_line({"runtime": {"ks": None}}) is None


def _job_store(path, iterations: int, workers: int):
    from bdsgd.stages.store import TraceStore

    from benchmarks.bench_fit import straggling_job
    from tests.stages.model.clusters import write_run

    x, hosts = straggling_job(0, iterations, workers)
    store = TraceStore(path)
    write_run(store, "profile", x, x < 0, hosts)
    return store


def test_too_short_a_profile_is_refused_in_one_line(tmp_path):
    store = _job_store(tmp_path / "traces", iterations=12, workers=3)
    result = _invoke("--traces", str(store.path), "--checkpoint", str(tmp_path / "m.pt"))
    assert result.exit_code != 0 and result.stderr.count("\n") == 1
    assert "too few to fit" in result.stderr and "--policy ecdf" in result.stderr
    assert not (tmp_path / "m.pt").exists()


def test_a_short_profile_is_marked_unusable_in_one_line_and_in_the_json(tmp_path):
    store = _job_store(tmp_path / "traces", iterations=30, workers=3)
    ckpt = tmp_path / "m.pt"
    result = _invoke("--traces", str(store.path), "--checkpoint", str(ckpt), *FAST, "--json")
    if result.exit_code != 0:  # refused: one line
        assert result.stderr.count("\n") == 1
        return
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["usable"] is False and "profile longer" in payload["unusable_reason"]
    said = " ".join(result.stderr.split())
    assert said.count("marked unusable") == 1 and "--policy ecdf" in said
    assert torch.load(ckpt, weights_only=True)["summary"]["usable"] is False


def test_steps_auto_is_the_default_and_the_json_says_what_was_taken(tmp_path):
    store = tiny_store(tmp_path / "traces")
    args = ["--window", "12", "--batch", "2", "--no-progress", "--no-early-stop", "--json"]
    result = _invoke("--traces", str(store.path), "--checkpoint", str(tmp_path / "m.pt"), *args)
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["steps"] == payload["planned_steps"] == 400  # (fit.AUTO_MIN_STEPS)
    assert "fitted 400 of 400 steps" in result.stderr
    bad = _invoke("--traces", str(store.path), "--checkpoint", str(tmp_path / "n.pt"),
                  "--steps", "many")  # fmt: skip
    assert bad.exit_code != 0 and "neither a whole number nor auto" in bad.stderr
