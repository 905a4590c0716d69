"""The ``bdsgd`` command group. Subcommands are imported only when used (torch and pyro are slow
to import, ``bdsgd --help`` should not wait for them)."""

from __future__ import annotations

import importlib
import os
import sys

# c10d logs a warning for every store wait that times out, and the ranks' early-ending delays
# time out by design; this must be set before torch is imported.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import click

# name -> "module:attribute" of the click command
COMMANDS = {
    "profile": "bdsgd_cli.profile:profile",
    "import": "bdsgd_cli.importer:import_cmd",
    "fit": "bdsgd_cli.fit:fit",
    "simulate": "bdsgd_cli.simulate:simulate",
    "train": "bdsgd_cli.train:train",
    "report": "bdsgd_cli.report:report",
    "check-traces": "bdsgd_cli.check_traces:check_traces_cmd",
}


NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # (click >= 8.2)


class LazyGroup(click.Group):
    """A group whose commands live in their own modules, imported on first use. A usage error
    (an unknown flag, a bad value click checks) is one line, as every other error is."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except NO_ARGS_IS_HELP as exc:  # plain ``bdsgd``: the help, as click shows it
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            hint = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
            click.echo(f"error: {exc.format_message()}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if _available(name)]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS or not _available(name):
            return None
        module, attr = COMMANDS[name].split(":")
        return getattr(importlib.import_module(module), attr)


def _available(name: str) -> bool:
    module = COMMANDS[name].split(":")[0]
    return importlib.util.find_spec(module) is not None


@click.group(
    cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": True}
)
@click.version_option(package_name="bdsgd")
def cli() -> None:
    """bdsgd: learn your cluster's run-times and stop waiting for stragglers.

    Typical loop: bdsgd profile -> bdsgd fit -> bdsgd simulate / bdsgd train -> bdsgd report.
    """


if __name__ == "__main__":  # python -m bdsgd_cli.main, as python -m bdsgd_cli
    cli()
