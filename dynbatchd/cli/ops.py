"""Operations commands of dynbatchctl: `warmup` (the result cache), `forget` (erase a user), `stop`,
and `keygen` (a CURVE key pair); and `infer --stream`'s printing."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from dynbatchd import config as cfgmod
from dynbatchd.cli.output import JsonOption, control, emit_json, err, fail, out
from dynbatchd.cli.target import user_keys_dir
from dynbatchd.cli.warmup import follow, warmed
from dynbatchd.client import Client, DynbatchdError
from dynbatchd.protocol import Chunk


def stream_infer(client: Client, model: str, text: str, as_json: bool, timeout: float, endpoint: str,
                 **kwargs: Any) -> None:
    """`dynbatchctl infer --stream`: the text as it arrives, then one line of counts and timing; with
    --json, each frame as one JSON line (chunks, then the final reply or the error). Exit 1 on error."""
    line = lambda data: (sys.stdout.write(json.dumps(data) + "\n"), sys.stdout.flush())   # noqa: E731
    try:
        for item in client.stream(model, text, **kwargs):
            if isinstance(item, Chunk):
                if as_json:
                    line({"id": item.id, "chunk": item.chunk, "text": item.text, "tokens": item.tokens})
                else:
                    sys.stdout.write(item.text)
                    sys.stdout.flush()
                continue
            t = item.timing
            timing = {"queue_us": t.queue_us, "ttft_us": t.ttft_us, "tpot_us": t.tpot_us,
                      "compute_us": t.compute_us, "total_us": t.total_us, "preemptions": t.preemptions,
                      "channel": t.channel}
            output = item.output.tolist() if hasattr(item.output, "tolist") else item.output
            if as_json:
                line({"id": item.id, "ok": True, "value": output, "timing": timing})
                return
            if not (isinstance(output, dict) and "finish_reason" in output):   # a model that does not generate
                out.print(f"{model} output (not streamed: not a generative model): {output!r}"[:2000],
                          highlight=False, markup=False)
                return
            value = output
            sys.stdout.write("\n")
            out.print(f"{value.get('finish_reason', '?')}: {value.get('output_tokens', '?')} tokens "
                      f"(prompt {value.get('prompt_tokens', '?')}), channel {t.channel}; time to first token "
                      f"{t.ttft_us / 1000:.1f} ms, per output token {t.tpot_us / 1000:.2f} ms, total "
                      f"{t.total_us / 1000:.1f} ms", highlight=False, markup=False)
    except KeyboardInterrupt:   # leaving the stream sent the daemon a cancel (the client's close delivers it)
        sys.stdout.write("\n")
        err.print("cancelled", highlight=False, markup=False)
        raise typer.Exit(130) from None
    except TimeoutError:
        raise fail(f"nothing more of the stream from {endpoint} within {timeout:g} s (is dynbatchd running?)", 1) from None
    except DynbatchdError as exc:
        if as_json:
            line({"ok": False, "error": {"code": exc.code, "message": str(exc)}})
        else:
            sys.stdout.write("\n")
            err.print(f"{exc.code}: {exc}", highlight=False, markup=False)
        raise typer.Exit(1) from None


def warmup(ctx: typer.Context,
           top_users: int = typer.Option(10_000, "--top-users", min=1, max=cfgmod.MAX_TOKENS,
                                         help="How many of the most active users."),
           model: Optional[str] = typer.Option(None, help="Only this model (default: every model)."),
           wait: bool = typer.Option(False, "--wait", help="Follow the warmup until every queued input has run "
                                                           "(a progress bar; one line a second when not a terminal)."),
           as_json: bool = JsonOption) -> None:
    """Precompute the top users' inputs into the result cache (run it from cron, off-peak).

    The inputs come from what the daemon observed (its \\[top_users] sketch), or
    from \\[plugins.warmup] source. They run through the warmup channel as it
    has room, so live traffic is not delayed. Exits 1 when the daemon refuses
    (the cache is off, no such model) or when there is nothing to warm (the
    reason is printed: no user observed yet, the sketch is off, the source
    file is missing or empty).

    Example crontab line: 0 3 * * * dynbatchctl warmup --top-users 10000
    """
    status_before = control(ctx, "status") if wait else None
    data = control(ctx, "warmup", top_users=top_users, **({"model": model} if model else {}))
    if not data.get("queued") and not data.get("already_cached"):
        if as_json:
            emit_json(data)
        reason = data.get("reason") or "no warmup plugin named any input (the daemon's log says why)"
        raise fail(f"nothing to warm up: {reason}", 1)
    if not as_json:
        out.print(f"queued {data['queued']} inputs for warmup in channel {data.get('channel', '?')} "
                  f"({data['already_cached']} already cached, backlog {data['backlog']})", highlight=False)
    if wait:
        channel = data["channel"]
        data["warmed"] = done = follow(lambda cmd: control(ctx, cmd), channel, data["queued"],
                                       warmed(status_before, channel),
                                       Console(stderr=True) if as_json else out) if data["queued"] else 0
        if not as_json:
            out.print(f"warmed {done} of {data['queued']} inputs", highlight=False)
    if as_json:
        emit_json(data)


def forget(ctx: typer.Context, user: str = typer.Argument(..., help="The user id, as clients send it in \"user\"."),
           tenant: Optional[str] = typer.Option(None, "--tenant", help="Only this tenant's user of that id "
                                                                     "(default: every tenant's)."),
           as_json: bool = JsonOption) -> None:
    """Erase a user: from the top-users sketch and its saved file, from the result cache, from the warmup backlog.

    The result-cache entries erased are those of the inputs the sketch kept for
    the user (looked up before the sketch forgets them); a warmup input of theirs
    already queued or running still runs, and its result is not kept. Prints
    what was erased, as counts. The audit log records it with the user id's
    keyed hash, never the id or an input. Needs an admin key over tcp://.
    """
    if not user:   # (a usage error, as every other: the daemon would refuse it, exit 1)
        raise fail("forget needs a user id, not an empty one", 2)
    data = control(ctx, "forget", user=user, **({"tenant": tenant} if tenant is not None else {}))
    if as_json:
        emit_json(data)
        return
    out.print(f"erased {data['sketch_users']} user record(s) with {data['sketch_inputs']} input(s) from the "
              f"top-users sketch{' (file rewritten)' if data.get('file_rewritten') else ''}, "
              f"{data['cache_entries']} result-cache entr{'y' if data['cache_entries'] == 1 else 'ies'}, "
              f"{data['warmup_inputs']} warmup input(s)", highlight=False, markup=False)


def stop(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help='Print {"state": "draining"}.')
         ) -> None:
    """Drain and stop the daemon (same as SIGTERM)."""
    data = control(ctx, "stop")
    if as_json:
        emit_json(data)
    else:
        out.print(data.get("state", "draining") if isinstance(data, dict) else "draining", highlight=False)


def keygen(name: str = typer.Argument("client", help="File name: NAME.key and NAME.key_secret (e.g. server, "
                                                      "or a client's name)."),
           directory: Optional[Path] = typer.Option(None, "--dir",
                                                    help="Where to write them (default: ~/.config/dynbatchd, "
                                                         "where dynbatchctl looks for client.key_secret)."),
           force: bool = typer.Option(False, "--force", help="Replace an existing key pair of that name."),
           as_json: bool = JsonOption) -> None:
    """Write a new CURVE key pair: NAME.key (public, 0644) and NAME.key_secret (both halves, 0600).

    For the daemon: dynbatchctl keygen server --dir /etc/dynbatchd/keys. For a
    client: dynbatchctl keygen, then copy ~/.config/dynbatchd/client.key into the
    daemon's /etc/dynbatchd/keys/clients/ (under a name of its own) and give the
    client the daemon's server.key.
    """
    where = directory or user_keys_dir()
    try:
        public_file, secret_file, public = cfgmod.write_keypair(where, name, force=force)
    except FileExistsError as exc:   # (a key file there already, or --dir a file: name the path either way)
        raise fail(f"{exc.filename or where}: {exc.strerror or exc}", 1) from None
    except ValueError as exc:
        raise fail(str(exc), 2) from None
    except OSError as exc:
        raise fail(f"{where}: cannot write: {exc.strerror or exc}", 1) from None
    if as_json:
        emit_json({"public_key": public, "public_file": str(public_file), "secret_file": str(secret_file)})
        return
    out.print(f"public key {public}\n  {public_file} (give it to the other side)\n"
              f"  {secret_file} (mode 0600: keep it here)", highlight=False, markup=False)
