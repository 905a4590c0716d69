"""Generate ``docs/cli.md``, the CLI reference, from the click commands' own ``--help``.

    python -m bdsgd_cli.docs docs/cli.md           # regenerate (make docs)
    python -m bdsgd_cli.docs docs/cli.md --check   # exit 1 if the file is out of date

Only commands whose module exists are included (the same rule as ``bdsgd --help``), so the page
grows as stages land; ``tests/cli/test_cli_reference.py`` fails when the page has drifted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from bdsgd.schemas.run_dir import write_atomic

from bdsgd_cli.main import COMMANDS, _available, cli

WIDTH = 100  # fixed, so the page does not depend on the terminal it was generated in
GENERATOR = ".venv/bin/python -m bdsgd_cli.docs docs/cli.md"
REGENERATE = f"make docs  (or: {GENERATOR})"
HEADER = f"""# CLI reference

Generated from each command's `--help` by `{GENERATOR}` (`make docs`).
Do not edit by hand: `tests/cli/test_cli_reference.py` fails when this page and the commands
disagree.
"""


def _context(command: click.Command, name: str, parent: click.Context | None) -> click.Context:
    """A context as click builds it for ``--help`` (context_settings applied), fixed width."""
    return command.make_context(
        name,
        [],
        parent=parent,
        resilient_parsing=True,
        terminal_width=WIDTH,
        max_content_width=WIDTH,
    )


def render() -> str:
    """The whole reference page: ``bdsgd --help`` then each available command's help."""
    root = _context(cli, "bdsgd", None)
    sections = [HEADER, "## bdsgd", "", "```text", root.get_help(), "```", ""]
    for name in COMMANDS:
        if not _available(name):
            continue
        command = cli.get_command(root, name)
        text = _context(command, name, root).get_help()
        sections += [f"## bdsgd {name}", "", "```text", text, "```", ""]
    return "\n".join(sections)


@click.command()
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path), default="docs/cli.md")
@click.option("--check", is_flag=True, help="Exit 1 if PATH differs from the generated page.")
def main(path: Path, check: bool) -> None:
    """Write (or --check) the CLI reference at PATH."""
    page = render()
    if check:
        current = path.read_text() if path.is_file() else ""
        if current != page:
            click.echo(f"{path} is out of date; regenerate with: {REGENERATE}", err=True)
            sys.exit(1)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, page.encode())
    click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()
