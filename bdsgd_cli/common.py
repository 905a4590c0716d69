"""Helpers shared by the click commands: error reporting, JSON output, config building."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import click

from stages.errors import BdsgdError

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def run_stage(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command body: a :class:`BdsgdError` or Ctrl-C becomes one line on stderr and a
    non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BdsgdError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_ERROR)
        except KeyboardInterrupt:
            click.echo("error: interrupted; everything written so far is kept", err=True)
            sys.exit(EXIT_INTERRUPTED)

    return wrapper


def emit_json(payload: dict) -> None:
    """Print the SPEC's JSON object as the last line on stdout."""
    click.echo(json.dumps(payload, sort_keys=False, default=float))
