"""`dynbatchd`: run the daemon, or check a configuration file."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from dynbatchd import __version__, config as cfgmod, logs
from dynbatchd.config.paths import StateDirError
from dynbatchd.errors import DynbatchdError
from dynbatchd.plugins import Plugins

class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


app = typer.Typer(help="dynbatchd: dynamic-batching inference daemon behind ZeroMQ.", no_args_is_help=True,
                  add_completion=False)
# soft_wrap: an error is one line, however narrow the terminal (grep and journald read it whole).
err = Console(stderr=True, soft_wrap=True)

CONFIG_HELP = ("TOML config file (default: $DYNBATCHD_CONFIG, else ./etc/dynbatchd.toml, "
               "else /etc/dynbatchd/dynbatchd.toml).")
ConfigOption = typer.Option(None, "--config", "-c", help=CONFIG_HELP)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one `error:` line on stderr (never wrapped, markup-safe); return the Exit to raise."""
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False)
    return typer.Exit(code)


def _config_path(path: Path | None) -> Path:
    found = cfgmod.find_config(path)
    if found is None:
        raise fail(f"no config file found (searched {cfgmod.search_order_text()})")
    return found


def load_checked(path: Path) -> tuple[cfgmod.Config, Plugins]:
    """Load, validate and compliance-check a config; exits with one clear line on error."""
    from dynbatchd.validation import validate_config

    try:
        plugins = Plugins.load()
        config = cfgmod.load(path)
        validate_config(config, plugins)
    except DynbatchdError as exc:   # a config, plugin or option error, as one line
        raise fail(str(exc)) from None
    return config, plugins


@app.command()
def start(config: Path = ConfigOption,
          log_level: Optional[LogLevel] = typer.Option(None, case_sensitive=False,
                                                       help="Log level (default: daemon.log_level).")) -> None:
    """Run the daemon in the foreground (systemd runs it this way, Type=notify)."""
    path = _config_path(config)
    cfg, plugins = load_checked(path)
    logs.setup(log_level.value if log_level else cfg.daemon.log_level, cfg.daemon.log_format)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from dynbatchd.service import Daemon, StartupError

    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run

    async def main() -> int:
        return await Daemon(cfg, plugins, config_path=str(path)).run()

    try:
        code = runner(main())
    except (StartupError, StateDirError) as exc:
        message = f"{path}: {exc}" if isinstance(exc, StateDirError) else str(exc)   # a config key: name its file
        if cfg.daemon.log_format == "json":   # every line on stderr one object
            logging.getLogger("dynbatchd").error("error: %s", message)
        else:
            print(f"error: {message}", file=sys.stderr)
        code = 1
    raise typer.Exit(code)


@app.command("check-config")
def check_config(path: Optional[Path] = typer.Argument(None, help="TOML config file to check (default: "
                                                                  "the file `start` would read).")) -> None:
    """Validate a config file (structure, references, runner options, compliance rules) without starting."""
    path = _config_path(path)
    cfg, _ = load_checked(path)
    rules = cfgmod.plugin_keys_of(cfg, "routing").get("rules", [])   # [[routing.rules]]: the routing plugin's
    Console().print(f"[green]ok[/green] {path}: {len(cfg.channels)} channels, {len(cfg.models)} models, "
                    f"{len(rules)} routing rules", highlight=False)


@app.command()
def version() -> None:
    """Print the version."""
    print(f"dynbatchd {__version__}")


def main() -> None:
    app()
