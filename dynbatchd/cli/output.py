"""What every dynbatchctl command shares: the consoles, the one-line error, JSON output, the control call.

A command module imports these from here, never from `dynbatchctl` (the app that
registers the commands), so no command module imports the app back.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

try:
    from typer._click.exceptions import NoArgsIsHelpError, UsageError   # typer 0.2x carries its own click
except ImportError:  # pragma: no cover - a typer on the installed click
    from click.exceptions import NoArgsIsHelpError, UsageError

from dynbatchd.cli import limits
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
    option) as one `error:` line and exit 2, as every other error, not click's boxed usage text.
    Every command it hands out has its numbers checked (`limits.guard`: finite and bounded)."""

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        return limits.guard(command) if command is not None else None

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except NoArgsIsHelpError as exc:   # its message is the help, printed already: say what is missing
            names = ", ".join(exc.ctx.command.list_commands(exc.ctx))
            raise fail(f"{exc.ctx.command_path} needs a command: {names}", 2) from None
        except UsageError as exc:
            raise fail(exc.format_message(), 2) from None


def check_writable(path: Path, option: str, folder: bool = False) -> None:
    """Refuse an output path that cannot be written before a long run, not after it: probe it
    (a folder is made, as the run would; a new file is made and removed), since permission bits
    say nothing for root or a read-only file system (``/proc``)."""
    try:
        if folder:
            path.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=path).close()
            return
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        raise typer.BadParameter(f"cannot write {path}: {exc.strerror or exc}", param_hint=f"'{option}'") from None


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
