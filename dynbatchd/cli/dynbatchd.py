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

from dynbatchd import __version__, config as cfgmod
from dynbatchd.config import ConfigError
from dynbatchd.plugins import PluginError, Plugins

class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


app = typer.Typer(help="dynbatchd: dynamic-batching inference daemon behind ZeroMQ.", no_args_is_help=True,
                  add_completion=False)
err = Console(stderr=True)

ConfigOption = typer.Option(None, "--config", "-c", envvar="DYNBATCHD_CONFIG",
                            help="TOML config file (default: /etc/dynbatchd/dynbatchd.toml).")


def _config_path(path: Path | None) -> Path:
    return path or Path(cfgmod.DEFAULT_CONFIG_PATHS[0])


def load_checked(path: Path) -> tuple[cfgmod.Config, Plugins]:
    """Load, validate and compliance-check a config; exits with one clear line on error."""
    from dynbatchd.validation import validate_config

    try:
        plugins = Plugins.load()
        config = cfgmod.load(path)
        validate_config(config, plugins)
    except (ConfigError, PluginError) as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2)
    return config, plugins


@app.command()
def start(config: Path = ConfigOption,
          log_level: Optional[LogLevel] = typer.Option(None, case_sensitive=False,
                                                       help="Log level (default: daemon.log_level).")) -> None:
    """Run the daemon in the foreground (systemd runs it this way, Type=notify)."""
    path = _config_path(config)
    cfg, plugins = load_checked(path)
    logging.basicConfig(level=(log_level.value if log_level else cfg.daemon.log_level).upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from dynbatchd.service import Daemon

    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run

    async def main() -> int:
        return await Daemon(cfg, plugins, config_path=str(path)).run()

    raise typer.Exit(runner(main()))


@app.command("check-config")
def check_config(path: Path = typer.Argument(..., help="TOML config file to check.")) -> None:
    """Validate a config file (structure, references, compliance rules) without starting."""
    cfg, _ = load_checked(path)
    Console().print(f"[green]ok[/green] {path}: {len(cfg.channels)} channels, {len(cfg.models)} models, "
                    f"{len(cfg.routing.rules)} routing rules", highlight=False)


@app.command()
def version() -> None:
    """Print the version."""
    print(f"dynbatchd {__version__}")


def main() -> None:
    app()
