"""`dynbatchctl`: talk to a running dynbatchd. Rich tables for people, --json for scripts."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console, Group
from rich.markup import escape
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dynbatchd import config as cfgmod
from dynbatchd.cli.plan import plan
from dynbatchd.cli.recommend import recommend
from dynbatchd.cli.simulate import simulate
from dynbatchd.client import Client, DynbatchdError, control_call

app = typer.Typer(help="Control and query a running dynbatchd.", no_args_is_help=True, add_completion=False)
out = Console()
err = Console(stderr=True)


class Target:
    """Where the daemon listens: flags, else the config file, else the defaults."""

    def __init__(self, endpoint: str | None, control: str | None, config: Path | None):
        daemon = cfgmod.DaemonSettings()
        if config is not None or os.environ.get("DYNBATCHD_CONFIG"):
            try:
                daemon = cfgmod.load(config or os.environ["DYNBATCHD_CONFIG"]).daemon
            except cfgmod.ConfigError as exc:
                err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
                raise typer.Exit(2)
        self.endpoint = endpoint or daemon.listen
        self.control = control or daemon.control


@app.callback()
def main_options(ctx: typer.Context,
                 endpoint: Optional[str] = typer.Option(None, envvar="DYNBATCHD_ENDPOINT",
                                                        help="Request socket (default: from --config, else tcp://127.0.0.1:5555)."),
                 control: Optional[str] = typer.Option(None, envvar="DYNBATCHD_CONTROL",
                                                       help="Control socket (default: from --config, else tcp://127.0.0.1:5556)."),
                 config: Optional[Path] = typer.Option(None, "--config", "-c",
                                                       help="Read the endpoints from this config file.")) -> None:
    ctx.obj = Target(endpoint, control, config)


JsonOption = typer.Option(False, "--json", help="Print JSON for scripts instead of tables.")


def _control(ctx: typer.Context, cmd: str, **args: Any) -> Any:
    try:
        return control_call(ctx.obj.control, cmd, **args)
    except DynbatchdError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(1)


def _emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@app.command()
def infer(ctx: typer.Context, model: str, text: str,
          tag: list[str] = typer.Option([], "--tag", "-t", help="Request tag (repeatable), e.g. urgent."),
          deadline_ms: Optional[float] = typer.Option(None, help="Deadline for this request (default: the channel's)."),
          request_type: Optional[str] = typer.Option(None, help="e.g. session_refresh."),
          user_frequency: Optional[str] = typer.Option(None, help="e.g. daily."),
          tokens: Optional[int] = typer.Option(None, help="Token count, if known (drives routing)."),
          timeout: float = typer.Option(60.0, help="Seconds to wait for the answer."),
          as_json: bool = JsonOption) -> None:
    """Send one text to MODEL and print its output with the timing."""
    client = Client(ctx.obj.endpoint)
    try:
        result = client.infer_result(model, text, tags=tag, deadline_ms=deadline_ms, request_type=request_type,
                                     user_frequency=user_frequency, tokens=tokens, timeout=timeout)
    except DynbatchdError as exc:
        err.print(f"[red]{exc.code}:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(1)
    except TimeoutError:
        err.print(f"[red]error:[/red] no answer from {escape(ctx.obj.endpoint)} within {timeout:g} s (is dynbatchd running?)")
        raise typer.Exit(1)
    finally:
        client.close()
    output = result.output.tolist() if hasattr(result.output, "tolist") else result.output
    t = result.timing
    timing = {"queue_ms": t.queue_us / 1000, "compute_ms": t.compute_us / 1000, "total_ms": t.total_us / 1000,
              "batch_size": t.batch_size, "channel": t.channel, "device": t.device, "simulated": t.simulated}
    if as_json:
        _emit_json({"id": result.id, "output": output, "timing": timing})
        return
    shape = getattr(result.output, "shape", None)
    out.print(f"[bold]{model}[/bold] output" + (f" shape {list(shape)}" if shape is not None else ""))
    out.print(output)
    label = " [yellow](SIMULATED device)[/yellow]" if t.simulated else ""
    out.print(f"channel {t.channel} on {t.device}: queue {timing['queue_ms']:.2f} ms, batch size {t.batch_size}, "
              f"compute {timing['compute_ms']:.2f} ms, total {timing['total_ms']:.2f} ms{label}", highlight=False)


def _window_text(w: dict[str, Any]) -> str:
    """`fixed 30ms`, `pattern:burst 30ms`: the policy, its traffic class if any, the window now."""
    text = w.get("policy", "?") + (f":{w['traffic']}" if w.get("traffic") else "")
    return text + (f" {w['window_ms']:.0f}ms" if isinstance(w.get("window_ms"), (int, float)) else "")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def status_view(data: dict[str, Any]) -> Group:
    """The status as rich renderables: a header line, the channel and device tables, the cache."""
    d = data["daemon"]
    parts: list[Any] = [Text.assemble((f"dynbatchd {d['version']}", "bold"), f" pid {d['pid']} ",
                                      (d["state"], "green"),
                                      f" up {d['uptime_s']:.0f} s, {d['listen']}  bad requests {d['bad_requests']}",
                                      f"  health {d['health']['score']:.2f}" if "health" in d else "")]
    table = Table(title="channels")
    for col in ("channel", "queue", "batches", "size", "fill", "p50 ms", "p99 ms", "overload", "refused",
                "missed", "window"):
        table.add_column(col, justify="left" if col in ("channel", "window") else "right", no_wrap=True)
    for name, c in data["channels"].items():
        table.add_row(name, str(c["queue_depth"]), str(c["batches"]), f"{c['mean_batch']:.1f}/{c['max_batch']}",
                      _pct(c["fill_rate"]), f"{c['p50_ms']:.1f}", f"{c['p99_ms']:.1f}",
                      str(c["rejected"]["overloaded"]), str(c["rejected"]["refused"]),
                      str(c["deadline_misses"]), _window_text(c["window"]))
    parts.append(table)
    dev = Table(title="devices")
    for col in ("device", "pid", "state", "in flight", "batches", "items", "busy", "restarts"):
        dev.add_column(col, justify="left" if col in ("device", "state") else "right")
    for w in data["devices"]:
        name = w["device"] + (" (simulated)" if w["simulated"] else "")
        dev.add_row(name, str(w["pid"]), w["state"], str(w["inflight"]), str(w["batches"]), str(w["items"]),
                    _pct(w["busy_fraction"]), str(w["restarts"]))
    parts.append(dev)
    if data.get("cache"):
        c = data["cache"]
        parts.append(Text(f"cache: {c['entries']}/{c['capacity']} entries, hit rate {_pct(c['hit_rate'])}, "
                          f"warmup backlog {c['warmup_backlog']}"))
    return Group(*parts)


@app.command()
def status(ctx: typer.Context, as_json: bool = JsonOption,
           watch: Optional[float] = typer.Option(None, "--watch", "-w", min=0.2,
                                                 help="Refresh every SECONDS until interrupted.")) -> None:
    """Per-channel queues and batching, per-device workers."""
    data = _control(ctx, "status")
    if as_json:
        _emit_json(data)
        return
    if watch is None:
        out.print(status_view(data))
        return
    with Live(status_view(data), console=out, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(watch)
                live.update(status_view(_control(ctx, "status")))
        except KeyboardInterrupt:
            pass


@app.command()
def plugins(ctx: typer.Context, as_json: bool = JsonOption) -> None:
    """Plugins the daemon loaded, the hooks each implements, and what they register."""
    data = _control(ctx, "plugins")
    if as_json:
        _emit_json(data)
        return
    table = Table(title="plugins")
    for col in ("name", "module", "hooks", "from"):
        table.add_column(col)
    for p in data["loaded"]:
        table.add_row(p["name"], p["module"], ", ".join(h.removeprefix("dynbatchd_") for h in p["hooks"]), p["source"])
    out.print(table)
    out.print(f"runners: {', '.join(data['runners'])}\nwindow policies: {', '.join(data['window_policies'])}\n"
              f"batch sizers: {', '.join(data['batch_sizers'])}", highlight=False)
    for name, why in data["broken"].items():
        out.print(f"[red]broken plugin {escape(name)}:[/red] {escape(why)}", highlight=False)


@app.command()
def tune(ctx: typer.Context, channel: str,
         max_batch: Optional[int] = typer.Option(None, min=1), window_ms: Optional[float] = typer.Option(None, min=0),
         deadline_ms: Optional[float] = typer.Option(None, min=0.001), queue_limit: Optional[int] = typer.Option(None, min=1),
         max_tokens: Optional[int] = typer.Option(None, min=0),
         min_share: Optional[float] = typer.Option(None, min=0, max=1),
         as_json: bool = JsonOption) -> None:
    """Change one channel's batching at run time (checked like a config file; not saved to disk)."""
    changes = {k: v for k, v in dict(max_batch=max_batch, window_ms=window_ms, deadline_ms=deadline_ms,
                                      queue_limit=queue_limit, max_tokens=max_tokens, min_share=min_share).items()
               if v is not None}
    if not changes:
        err.print("[red]error:[/red] give at least one setting, e.g. --window-ms 20")
        raise typer.Exit(2)
    data = _control(ctx, "tune", channel=channel, **changes)
    if as_json:
        _emit_json(data)
    else:
        out.print(f"channel [bold]{channel}[/bold] now: " + ", ".join(f"{k}={data[k]}" for k in changes), highlight=False)


@app.command()
def reload(ctx: typer.Context) -> None:
    """Re-read the daemon's config file (same as SIGHUP); a refused file leaves the old one running."""
    data = _control(ctx, "reload")
    pending = data["needs_restart"]
    out.print("reloaded" + (f"; restart needed to change: {', '.join(pending)}" if pending else ""))


@app.command("config")
def show_config(ctx: typer.Context) -> None:
    """Print the configuration the daemon runs with, as JSON."""
    _emit_json(_control(ctx, "config"))


@app.command()
def warmup(ctx: typer.Context,
           top_users: int = typer.Option(10_000, "--top-users", min=1, help="How many of the most active users."),
           model: Optional[str] = typer.Option(None, help="Only this model (default: every model)."),
           as_json: bool = JsonOption) -> None:
    """Precompute the top users' inputs into the result cache (run it from cron, off-peak).

    Example crontab line: 0 3 * * * dynbatchctl warmup --top-users 10000
    """
    data = _control(ctx, "warmup", top_users=top_users, **({"model": model} if model else {}))
    if as_json:
        _emit_json(data)
    else:
        out.print(f"queued {data['queued']} inputs for warmup ({data['already_cached']} already cached, "
                  f"backlog {data['backlog']})", highlight=False)


@app.command()
def stop(ctx: typer.Context) -> None:
    """Drain and stop the daemon (same as SIGTERM)."""
    _control(ctx, "stop")
    out.print("draining")


app.command("plan")(plan)
app.command("simulate")(simulate)
app.command("recommend")(recommend)


def main() -> None:
    app()
