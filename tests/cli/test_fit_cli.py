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
    assert payload["checkpoint"] == str(ckpt)
    assert "ewma" in result.stderr
    assert torch.load(ckpt, weights_only=True)["summary"]["val_nll"] == payload["val_nll"]


def test_init_continues_from_a_checkpoint(tmp_path):
    store = tiny_store(tmp_path / "traces")
    first, second = tmp_path / "a.pt", tmp_path / "b.pt"
    assert _invoke("--traces", str(store.path), "--checkpoint", str(first), *FAST).exit_code == 0
    result = _invoke(
        "--traces", str(store.path), "--checkpoint", str(second), "--init", str(first), *FAST
    )
    assert result.exit_code == 0, result.stderr and second.is_file()


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
    from bdsgd_cli.fit import fit
    from stages.fit import FitConfig

    fields = {
        f.name: f.default
        for f in dataclasses.fields(FitConfig)
        if f.default is not dataclasses.MISSING
    }
    shared = {p.name: p.default for p in fit.params if p.name in fields and p.default is not None}
    assert "steps" in shared
    for name, default in shared.items():
        assert default == fields[name], name
