"""What every dynbatchctl command shares: the consoles, the one-line error, JSON output, the control call.

A command module imports these from here, never from `dynbatchctl` (the app that
registers the commands), so no command module imports the app back.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

try:
    from typer._click.exceptions import UsageError   # typer 0.2x carries its own click
except ImportError:  # pragma: no cover - a typer on the installed click
    from click.exceptions import UsageError

from dynbatchd.client import DynbatchdError, NotRunning

out = Console()
# soft_wrap: an error is one line however narrow the terminal, never broken mid-sentence.
err = Console(stderr=True, soft_wrap=True)

NOT_RUNNING = 3   # exit status: nothing listens at the daemon's address (see dynbatchctl(1))

JsonOption = typer.Option(False, "--json", help="Print JSON for scripts instead of tables.")


def fail(message: str, code: int) -> typer.Exit:
    """Print one `error:` line on stderr (markup-safe, never wrapped); return the Exit to raise."""
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False)
    return typer.Exit(code)


class OneLineErrors(TyperGroup):
    """A command's usage error (``--max-batch abc``, a value out of an option's range, an unknown
    option) as one `error:` line and exit 2, as every other error, not click's boxed usage text."""

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            raise fail(exc.format_message(), 2) from None


def exit_code(exc: DynbatchdError) -> int:
    """NOT_RUNNING (3) when the daemon is not there at all, else 1."""
    return NOT_RUNNING if isinstance(exc, NotRunning) else 1


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def control(ctx: typer.Context, cmd: str, **args: Any) -> Any:
    """One control command to the daemon (`ctx.obj`, a `Target`); a refusal is one line and its exit code."""
    try:
        return ctx.obj.call(cmd, **args)
    except DynbatchdError as exc:
        raise fail(str(exc), exit_code(exc)) from None
