"""docs/cli.md is generated from the commands' --help and must not drift from them."""

from __future__ import annotations

from pathlib import Path

from bdsgd_cli.docs import REGENERATE, render
from bdsgd_cli.main import COMMANDS, _available

CLI_MD = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_cli_reference_is_up_to_date():
    current = CLI_MD.read_text() if CLI_MD.is_file() else ""
    assert current == render(), f"docs/cli.md is out of date; regenerate with: {REGENERATE}"


def test_reference_covers_exactly_the_available_commands():
    page = render()
    for name in COMMANDS:
        assert (f"## bdsgd {name}\n" in page) == _available(name), name
    assert "Usage: bdsgd report [OPTIONS] RUN_DIR..." in page
