"""`dynbatchctl http-key`: API keys of the HTTP door (create, revoke, list), kept only as hashes.

Works on the files (``KEYS_DIR/http/NAME.hash``), not through the daemon: the door reads a key's
file at each request, so a key created or revoked here takes effect at once, without a restart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from dynbatchd import config as cfgmod, httpkeys

app = typer.Typer(help="API keys of the HTTP door (\\[http] keys = true): create, revoke, list.",
                  no_args_is_help=True, add_completion=False)

DirOption = typer.Option(None, "--dir", help="The keys directory (default: the config's [daemon] keys_dir); "
                                             "keys go in its http/ subdirectory.")


def _root(ctx: typer.Context, directory: Optional[Path]) -> Path:
    if directory is not None:
        return directory
    target = ctx.obj if ctx.obj is not None else None
    path = cfgmod.find_config(getattr(target, "config", None))
    try:
        daemon = cfgmod.load(path).daemon if path is not None else cfgmod.DaemonSettings()
    except cfgmod.ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return Path(daemon.keys_dir)


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


@app.command("create")
def create(ctx: typer.Context,
           name: str = typer.Argument(..., help="The key's name (letters, digits, '-'): its file is "
                                                "KEYS_DIR/http/NAME.hash."),
           tenant: str = typer.Option(..., "--tenant", help="The tenant the key's requests run as (quotas, "
                                                            "isolated channels, cache)."),
           channels: str = typer.Option("", "--channels", help="Comma-separated channels the key may reach "
                                                               "(default: any)."),
           directory: Optional[Path] = DirOption,
           force: bool = typer.Option(False, "--force", help="Replace the key of that name (revoking it)."),
           as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Make an API key: print it once (it is stored only as a hash), mapped to a tenant."""
    root = _root(ctx, directory)
    wanted = [c.strip() for c in channels.split(",") if c.strip()]
    try:
        key = httpkeys.create(root, name, tenant, wanted, force=force)
    except FileExistsError as exc:
        raise _fail(str(exc), 1) from None
    except ValueError as exc:
        raise _fail(str(exc), 2) from None
    except OSError as exc:
        raise _fail(f"{httpkeys.keys_dir(root)}: cannot write: {exc.strerror or exc}", 1) from None
    if as_json:
        typer.echo(json.dumps({"name": name, "tenant": tenant, "channels": wanted, "key": key}))
    else:
        typer.echo(key)
        typer.echo(f"(shown once; its hash is in {httpkeys.keys_dir(root) / (name + httpkeys.SUFFIX)}; clients "
                   "send it as 'Authorization: Bearer KEY')", err=True)


@app.command("revoke")
def revoke(ctx: typer.Context, name: str = typer.Argument(..., help="The key's name."),
           directory: Optional[Path] = DirOption) -> None:
    """Revoke a key (remove its file): refused from the next request on, without a restart."""
    if not httpkeys.revoke(_root(ctx, directory), name):
        raise _fail(f"no HTTP key named {name!r}", 1)
    typer.echo(f"revoked {name}")


@app.command("list")
def list_keys(ctx: typer.Context, directory: Optional[Path] = DirOption,
              as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The keys by name, with their tenant and channels (never the keys: only their hashes are kept)."""
    records = httpkeys.read_all(httpkeys.keys_dir(_root(ctx, directory)))
    rows = [{"name": n, "tenant": r.tenant, "channels": r.channels} for n, r in records.items()]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for row in rows:
        typer.echo(f"{row['name']}\ttenant {row['tenant']}\tchannels {','.join(row['channels']) or 'any'}")
