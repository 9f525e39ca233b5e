"""`dynbatchctl`: talk to a running dynbatchd. Rich tables for people, --json for scripts."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import typer
from typer.core import TyperGroup

try:
    from typer._click.exceptions import UsageError   # typer 0.2x carries its own click
except ImportError:  # pragma: no cover - a typer on the installed click
    from click.exceptions import UsageError
from rich.console import Console, Group
from rich.markup import escape
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from dynbatchd import config as cfgmod
from dynbatchd.cli.bench import bench
from dynbatchd.cli.capacity import capacity
from dynbatchd.cli.plan import plan
from dynbatchd.cli.recommend import recommend
from dynbatchd.cli.simulate import simulate
from dynbatchd.cli.tune import tune
from dynbatchd.cli.warmup import follow, warmed
from dynbatchd.client import Client, CurveKeys, DynbatchdError, NotRunning, check_running, control_call

out = Console()
# soft_wrap: an error is one line however narrow the terminal, never broken mid-sentence.
err = Console(stderr=True, soft_wrap=True)


NOT_RUNNING = 3   # exit status: nothing listens at the daemon's address (see dynbatchctl(1))


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


app = typer.Typer(help="Control and query a running dynbatchd.", no_args_is_help=True, add_completion=False,
                  cls=OneLineErrors)


# CURVE keys of dynbatchctl (a daemon with [daemon] curve on, over tcp://): --curve-key and
# --server-key, else these variables, else the defaults below. Read by hand, not as typer
# envvars, so `--help` never prints a key path taken from the environment as a default.
CURVE_KEY_ENV = "DYNBATCHD_CURVE_KEY"
SERVER_KEY_ENV = "DYNBATCHD_SERVER_KEY"


def user_keys_dir() -> Path:
    """Where `keygen` puts a client's key pair and dynbatchctl looks for it: ~/.config/dynbatchd."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "dynbatchd"


class Target:
    """Where the daemon listens: flags, else the config file (the one search order), else the defaults.

    The file is read only when an endpoint is asked for and no flag gave it,
    so `plan`, `simulate`, or a command given both endpoints, never trip over
    a config file they do not need. The default control socket is the daemon's
    own default (`dynbatchd.config.default_control`): its runtime directory.
    """

    def __init__(self, endpoint: str | None, control: str | None, config: Path | None,
                 curve_key: Path | None = None, server_key: Path | None = None):
        self.config = config
        self._endpoint, self._control = endpoint, control
        self._curve_key = curve_key or (Path(os.environ[CURVE_KEY_ENV]) if os.environ.get(CURVE_KEY_ENV) else None)
        self._server_key = server_key or (Path(os.environ[SERVER_KEY_ENV]) if os.environ.get(SERVER_KEY_ENV) else None)
        self._daemon: cfgmod.DaemonSettings | None = None
        self._keys: CurveKeys | None = None

    def _settings(self) -> cfgmod.DaemonSettings:
        if self._daemon is None:
            path = cfgmod.find_config(self.config)
            try:
                self._daemon = cfgmod.load(path).daemon if path is not None else cfgmod.DaemonSettings()
            except cfgmod.ConfigError as exc:
                raise fail(str(exc), 2) from None
        return self._daemon

    @property
    def endpoint(self) -> str:
        return self._endpoint or self._settings().listen

    @property
    def control(self) -> str:
        return self._control or self._settings().control

    def curve(self, endpoint: str) -> CurveKeys | None:
        """The CURVE keys for talking to `endpoint`, or None (not tcp://, or no keys and CURVE off).

        Keys given (flag or environment) are used; otherwise, when the config file
        says ``curve = true``, this user's ~/.config/dynbatchd/client.key_secret and the
        daemon's KEYS_DIR/server.key. A key that will not load is one line and exit 2.
        """
        if not endpoint.startswith("tcp://"):
            return None
        if self._keys is not None:
            return self._keys
        client, server = self._curve_key, self._server_key
        if client is None and server is None:
            if (self._endpoint and self._control) or not self._settings().curve:
                return None
        client = client or user_keys_dir() / "client.key_secret"
        server = server or cfgmod.server_public_key_file(self._settings())
        try:
            self._keys = CurveKeys.load(client, server)
        except cfgmod.KeyFileError as exc:
            raise fail(f"CURVE keys for {endpoint}: {exc} (--curve-key FILE and --server-key FILE; "
                       "dynbatchctl keygen makes a key pair)", 2) from None
        return self._keys

    def curve_args(self, endpoint: str) -> dict[str, Any]:
        """``{"curve": keys}`` where `endpoint` takes CURVE keys, else nothing (no argument at all)."""
        keys = self.curve(endpoint)
        return {"curve": keys} if keys is not None else {}


@app.callback()
def main_options(ctx: typer.Context,
                 endpoint: Optional[str] = typer.Option(None, envvar="DYNBATCHD_ENDPOINT",
                                                        help="Request socket (default: from the config file, "
                                                             "else tcp://127.0.0.1:5555)."),
                 control: Optional[str] = typer.Option(None, envvar="DYNBATCHD_CONTROL",
                                                       help="Control socket (default: from the config file, "
                                                            "else the daemon's runtime directory: "
                                                            "$RUNTIME_DIRECTORY, /run/dynbatchd, "
                                                            "$XDG_RUNTIME_DIR/dynbatchd or /tmp/dynbatchd-UID, "
                                                            "then /control.sock)."),
                 config: Optional[Path] = typer.Option(None, "--config", "-c",
                                                       help="Config file for every command (default: "
                                                            "$DYNBATCHD_CONFIG, else ./etc/dynbatchd.toml, "
                                                            "else /etc/dynbatchd/dynbatchd.toml)."),
                 curve_key: Optional[Path] = typer.Option(None, "--curve-key",
                                                          help="This client's CURVE key pair, a NAME.key_secret "
                                                               "file (default: $DYNBATCHD_CURVE_KEY, else, when "
                                                               "the config has curve = true, "
                                                               "~/.config/dynbatchd/client.key_secret). Used on "
                                                               "tcp:// only."),
                 server_key: Optional[Path] = typer.Option(None, "--server-key",
                                                           help="The daemon's public key, server.key (default: "
                                                                "$DYNBATCHD_SERVER_KEY, else KEYS_DIR/server.key "
                                                                "of the config).")) -> None:
    ctx.obj = Target(endpoint, control, config, curve_key, server_key)


JsonOption = typer.Option(False, "--json", help="Print JSON for scripts instead of tables.")


def _control(ctx: typer.Context, cmd: str, **args: Any) -> Any:
    try:
        return control_call(ctx.obj.control, cmd, **ctx.obj.curve_args(ctx.obj.control), **args)
    except DynbatchdError as exc:
        raise fail(str(exc), exit_code(exc)) from None


def exit_code(exc: DynbatchdError) -> int:
    """NOT_RUNNING (3) when the daemon is not there at all, else 1."""
    return NOT_RUNNING if isinstance(exc, NotRunning) else 1


def _emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


SHOWN_VALUES = 6   # a longer output is summarised in human mode: shape, first values, L2 norm


def output_summary(output: Any) -> list[str]:
    """Lines that describe an output for a person: a long vector as shape, norm and its first values."""
    values = output if isinstance(output, np.ndarray) else None
    if values is None and isinstance(output, list) and output and \
            all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in output):
        values = np.asarray(output, dtype=np.float64)
    if values is None or values.size <= SHOWN_VALUES or values.dtype.kind not in "biuf":
        return [repr(output.tolist() if isinstance(output, np.ndarray) else output)]
    flat = values.reshape(-1).astype(np.float64)
    first = ", ".join(f"{v:.4f}" for v in flat[:SHOWN_VALUES])
    return [f"shape {list(values.shape)} {values.dtype}, L2 norm {float(np.linalg.norm(flat)):.4f} "
            "(--json prints all)", f"first {SHOWN_VALUES} of {flat.size}: {first}, ..."]


@app.command()
def infer(ctx: typer.Context, model: str, text: str,
          tag: list[str] = typer.Option([], "--tag", "-t", help="Request tag (repeatable), e.g. urgent."),
          deadline_ms: Optional[float] = typer.Option(None, help="Deadline for this request (default: the channel's)."),
          request_type: Optional[str] = typer.Option(None, help="e.g. session_refresh."),
          user_frequency: Optional[str] = typer.Option(None, help="e.g. daily."),
          tokens: Optional[int] = typer.Option(None, help="Token count, if known (drives routing)."),
          timeout: float = typer.Option(60.0, help="Seconds to wait for the answer."),
          as_json: bool = JsonOption) -> None:
    """Send one text to MODEL and print its output (a long vector summarised) with the timing."""
    try:
        check_running(ctx.obj.endpoint)
    except NotRunning as exc:
        raise fail(str(exc), NOT_RUNNING) from None
    client = Client(ctx.obj.endpoint, timeout=timeout, **ctx.obj.curve_args(ctx.obj.endpoint))
    try:
        result = client.infer_result(model, text, tags=tag, deadline_ms=deadline_ms, request_type=request_type,
                                     user_frequency=user_frequency, tokens=tokens)
    except TimeoutError:
        raise fail(f"no answer from {ctx.obj.endpoint} within {timeout:g} s (is dynbatchd running?)", 1) from None
    except DynbatchdError as exc:
        err.print(f"[red]{escape(exc.code)}:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(1) from None
    finally:
        client.close()
    output = result.output.tolist() if hasattr(result.output, "tolist") else result.output
    t = result.timing
    timing = {"queue_ms": t.queue_us / 1000, "compute_ms": t.compute_us / 1000, "total_ms": t.total_us / 1000,
              "batch_size": t.batch_size, "channel": t.channel, "device": t.device, "simulated": t.simulated}
    if as_json:
        _emit_json({"id": result.id, "output": output, "timing": timing})
        return
    summary = output_summary(result.output)
    out.print(Text.assemble((model, "bold"), " output: ", summary[0]))
    for line in summary[1:]:
        out.print(Text(line))
    label = " [yellow](SIMULATED device)[/yellow]" if t.simulated else ""
    out.print(f"channel {escape(t.channel)} on {escape(t.device)}, batch size {t.batch_size}{label}:\n"
              f"  queue {timing['queue_ms']:.2f} ms, compute {timing['compute_ms']:.2f} ms, "
              f"total {timing['total_ms']:.2f} ms", highlight=False)


def _window_text(w: dict[str, Any]) -> str:
    """`fixed 30ms`, `pattern:burst 30ms`: the policy, its traffic class if any, the window now."""
    text = w.get("policy", "?") + (f":{w['traffic']}" if w.get("traffic") else "")
    return text + (f" {w['window_ms']:.0f}ms" if isinstance(w.get("window_ms"), (int, float)) else "")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


# Columns of the status tables: (header, rank, cell). When the terminal is too narrow, the
# highest rank goes first (the later column of a tie first); rank 0 always stays. --wide keeps all.
CHANNEL_COLUMNS: list[tuple[str, int, Any]] = [
    ("channel", 0, lambda n, c: n),
    ("queue", 1, lambda n, c: str(c["queue_depth"])),
    ("batches", 5, lambda n, c: str(c["batches"])),
    ("size", 2, lambda n, c: f"{c['mean_batch']:.1f}/{c['max_batch']}"),
    ("fill", 5, lambda n, c: _pct(c["fill_rate"])),
    ("p50 ms", 4, lambda n, c: f"{c['p50_ms']:.1f}"),
    ("p99 ms", 1, lambda n, c: f"{c['p99_ms']:.1f}"),
    ("overload", 3, lambda n, c: str(c["rejected"]["overloaded"])),
    ("refused", 6, lambda n, c: str(c["rejected"]["refused"])),
    ("missed", 2, lambda n, c: str(c["deadline_misses"])),
    ("window", 3, lambda n, c: _window_text(c["window"])),
]
DEVICE_COLUMNS: list[tuple[str, int, Any]] = [
    ("device", 0, lambda w: w["device"] + (" (simulated)" if w["simulated"] else "")),
    ("where", 3, lambda w: f"{w['node']} actor {w['actor'][:12]}" if w.get("node") else "local"),
    ("pid", 5, lambda w: " ".join(str(f["pid"]) for f in w["workers"]) if len(w.get("workers", ())) > 1
     else str(w["pid"])),   # several feeders ([devices] workers_per_device): each one's pid
    ("state", 1, lambda w: w["state"] + (f" ({sum(f['state'] == 'ready' for f in w['workers'])}/{len(w['workers'])} "
                                         "workers)" if len(w.get("workers", ())) > 1 else "")),
    ("in flight", 3, lambda w: str(w["inflight"])),
    ("batches", 4, lambda w: str(w["batches"])),
    ("items", 5, lambda w: str(w["items"])),
    ("busy", 2, lambda w: _pct(w["busy_fraction"])),
    ("restarts", 2, lambda w: str(w["restarts"])),
    ("batch limit", 3, lambda w: _limit_text(w.get("batch_limit"))),
]
LEFT = {"channel", "window", "device", "state", "where", "batch limit"}


def _limit_text(limit: dict[str, Any] | None) -> str:
    """`8 items (runner)`, `4 items, 2048 tokens (learned after OOM)`, `-` (no limit)."""
    if not limit or not (limit["items"] or limit["tokens"]):
        return "-"
    parts = [f"{limit['items']} items"] * bool(limit["items"]) + [f"{limit['tokens']} tokens"] * bool(limit["tokens"])
    return ", ".join(parts) + (f" ({limit['source']})" if limit.get("source") else "")


def fitted_table(title: str, columns: list[tuple[str, int, Any]], rows: list[tuple], console: Console,
                 width: int | None) -> Table:
    """A table of `rows` (each the arguments of every cell function) that fits `width` columns.

    Columns are dropped, lowest priority first, until the table's natural width
    fits; a caption says how many are hidden. `width` None keeps every column.
    """
    kept = list(columns)
    drop_order = sorted((c for c in columns if c[1] > 0), key=lambda c: (-c[1], -columns.index(c)))

    def build(cols: list, hidden: int) -> Table:
        table = Table(title=title, caption=f"{hidden} columns hidden: --wide shows all" if hidden else None)
        for header, _, _ in cols:
            table.add_column(header, justify="left" if header in LEFT else "right", no_wrap=True)
        for args in rows:
            table.add_row(*(cell(*args) for _, _, cell in cols))
        return table

    unbounded = console.options.update_width(1 << 16)   # the table's natural width, not one clamped to the console

    def natural(table: Table) -> int:
        return Measurement.get(console, unbounded, table).maximum

    table = build(kept, 0)
    while width is not None and drop_order and natural(table) > width:
        kept.remove(drop_order.pop(0))
        table = build(kept, len(columns) - len(kept))
    return table


def status_view(data: dict[str, Any], console: Console | None = None, wide: bool = False) -> Group:
    """The status as rich renderables: a header line, the channel and device tables, the cache.

    Fits the console's width (columns dropped by priority) unless `wide`.
    """
    console = console or out
    width = None if wide else console.width
    d = data["daemon"]
    parts: list[Any] = [Text.assemble((f"dynbatchd {d['version']}", "bold"), f" pid {d['pid']} ",
                                      (d["state"], "green"),
                                      f" up {d['uptime_s']:.0f} s, {d['listen']}  bad requests {d['bad_requests']}",
                                      f"  health {d['health']['score']:.2f}" if "health" in d else "")]
    parts.append(fitted_table("channels", CHANNEL_COLUMNS, list(data["channels"].items()), console, width))
    parts.append(fitted_table("devices", DEVICE_COLUMNS, [(w,) for w in data["devices"]], console, width))
    for name, c in ((data.get("canary") or {}).get("running") or {}).items():
        changes = ", ".join(f"{k}={v}" for k, v in c["changes"].items() if v is not None)
        parts.append(Text(f"canary of {name} ({changes}): {100 * c['share']:g}% of its traffic"
                          f"{' as shadow copies' if c['shadow'] else ''} in {c['twin']}, "
                          f"{c['seconds']:.0f}/{c['duration_s']:g} s; on time: candidate "
                          f"{_pct(c['candidate']['on_time'])} of {c['candidate']['answered']}, running setting "
                          f"{_pct(c['incumbent']['on_time'])} of {c['incumbent']['answered']}"))
    parts += [Text(line) for line in overrides_lines(data.get("overrides") or {})]
    if data.get("cache"):
        c = data["cache"]
        parts.append(Text(f"cache: {c['entries']}/{c['capacity']} entries, hit rate {_pct(c['hit_rate'])}, "
                          f"warmup backlog {c['warmup_backlog']}"))
    return Group(*parts)


def overrides_lines(overrides: dict[str, dict[str, Any]]) -> list[str]:
    """`tuned standard: max_batch=8, window_ms=20 (by local since 2025-01-02 03:04 UTC)`: the keys
    the tuning drop-in overrides, one line per channel and author."""
    lines = []
    for channel, keys in overrides.items():
        groups: dict[tuple[str, str], list[str]] = {}
        for key, o in keys.items():
            when = str(o["since"])[:16].replace("T", " ")
            groups.setdefault((o["by"], when), []).append(f"{key}={_value_text(o['value'])}")
        for (by, when), settings in groups.items():
            lines.append(f"tuned {channel}: {', '.join(settings)} (by {by} since {when} UTC)")
    return lines


def _value_text(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("policy", "fixed") if value else "fixed"
    return "fixed" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def compliance_view(summary: dict[str, Any]) -> Group:
    """`status --compliance`: counts per rule, then the latest decisions (ids only, never payloads)."""
    counts = Table(title="compliance decisions", title_justify="left")
    for column in ("rule", "action", "count"):
        counts.add_column(column, justify="right" if column == "count" else "left")
    for d in summary["decisions"]:
        counts.add_row(d["rule"], d["action"], f"{d['count']:,}")
    if not summary["decisions"]:
        counts.add_row("(none)", "", "0")
    recent = Table(title="latest", title_justify="left")
    for column in ("time", "rule", "action", "channel", "tenant", "request id"):
        recent.add_column(column)
    for d in summary["recent"]:
        recent.add_row(d["time"], d["rule"], d["action"], d["channel"], str(d["tenant"]), str(d["request_id"]))
    where = summary.get("audit_log") or "not written"
    return Group(counts, recent, Text(f"audit log: {where}", style="dim"))


def _print_status(view: Group, wide: bool) -> None:
    if wide:   # as wide as the tables need, even past the terminal's edge
        need = Measurement.get(out, out.options.update_width(1 << 16), view).maximum
        Console(file=out.file, width=max(out.width, need), color_system=out.color_system and "auto",
                force_terminal=out.is_terminal).print(view)
    else:
        out.print(view)


@app.command()
def status(ctx: typer.Context, as_json: bool = JsonOption,
           watch: Optional[float] = typer.Option(None, "--watch", "-w", min=0.2,
                                                 help="Refresh every SECONDS until interrupted (one plain "
                                                      "frame per interval when not on a terminal)."),
           once: bool = typer.Option(False, "--once", help="Print one frame and exit, even with --watch."),
           wide: bool = typer.Option(False, "--wide", help="Show every column, however wide the table."),
           compliance: bool = typer.Option(False, "--compliance",
                                           help="The compliance audit summary instead: refusals and "
                                                "run-alone decisions per rule, the latest ones, the audit log.")
           ) -> None:
    """Per-channel queues and batching, per-device workers (fits the terminal; --wide shows all)."""
    data = _control(ctx, "status")
    if compliance:
        summary = data.get("compliance") or {"decisions": [], "recent": [], "audit_log": None}
        if as_json:
            _emit_json(summary)
        else:
            out.print(compliance_view(summary))
        return
    if as_json:
        _emit_json(data)
        return
    if watch is None or once:
        _print_status(status_view(data, wide=wide), wide)
        return
    try:
        if not out.is_terminal:   # a pipe or a log: no cursor tricks, one frame per interval
            while True:
                out.print(Text(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}", style="dim"))
                _print_status(status_view(data, wide=wide), wide)
                time.sleep(watch)
                data = _control(ctx, "status")
        with Live(status_view(data, wide=wide), console=out, refresh_per_second=4) as live:
            while True:
                time.sleep(watch)
                live.update(status_view(_control(ctx, "status"), wide=wide))
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


ForceOption = typer.Option(False, "--force", help="Apply the change even if the risk assessment refuses "
                                                  "it (the daemon logs that it was forced).")
DryRunOption = typer.Option(False, "--dry-run", help="Print what would change and the risk verdict; "
                                                     "change nothing.")


@app.command()
def reload(ctx: typer.Context, force: bool = ForceOption, dry_run: bool = DryRunOption,
           as_json: bool = typer.Option(False, "--json", help='Print {"needs_restart": [...], "changes": ..., '
                                                              '"risk": ...}.')) -> None:
    """Re-read the daemon's config file (same as SIGHUP), with the tuning drop-in on top; a refused
    file, or a risky one without --force, leaves the running configuration as it is."""
    data = _control(ctx, "reload", **({"force": True} if force else {}), **({"dry_run": True} if dry_run else {}))
    if as_json:
        _emit_json(data)
        return
    print_plan(data)
    pending = data["needs_restart"]
    word = "reloaded" if data.get("applied", True) else "dry run, nothing changed"
    out.print(word + (f"; restart needed to change: {', '.join(pending)}" if pending else ""), highlight=False)


def print_plan(data: dict[str, Any]) -> None:
    """What a reload (or a checked file) changes, each channel's risk verdict, the overrides it drops."""
    for channel, keys in (data.get("changes") or {}).items():
        changed = ", ".join(f"{k} {_value_text(a)} -> {_value_text(b)}" for k, (a, b) in keys.items())
        out.print(f"channel {channel}: {changed}", highlight=False, markup=False)
        verdict = (data.get("risk") or {}).get(channel)
        if verdict:
            word = ("risk accepted" if verdict["accepted"] else "RISK REFUSED") if verdict.get("assessed", True) \
                else "risk"
            out.print(f"  {word}: {verdict['reason']}", highlight=False, markup=False)
    for key in data.get("dropped_overrides") or ():
        out.print(f"override of {key} dropped: the config file changed it", highlight=False, markup=False)


@app.command("check-config")
def check_config(ctx: typer.Context,
                 path: Optional[Path] = typer.Argument(None, help="Config file (default: the one the daemon "
                                                                  "reads, from the search order)."),
                 risk: bool = typer.Option(False, "--risk", help="Also ask the running daemon for the risk of "
                                           "the channel changes this file makes, on its observed traffic."),
                 as_json: bool = JsonOption) -> None:
    """Check a config file as the daemon would load it; with --risk, what a reload to it would change
    and the risk verdict of each change (nothing is changed). Exits 1 when the risk is refused."""
    from dynbatchd.plugins import Plugins
    from dynbatchd.validation import validate_config

    found = cfgmod.find_config(path or ctx.obj.config)
    if found is None:
        raise fail(f"no config file found (searched {cfgmod.search_order_text()})", 2)
    try:
        cfg = cfgmod.load(found)
        validate_config(cfg, Plugins.load())
    except cfgmod.ConfigError as exc:
        raise fail(str(exc), 2) from None
    data: dict[str, Any] = {"file": str(found), "ok": True}
    if risk:
        raw = cfgmod.to_dict(cfg)
        raw.pop("source", None)
        data.update(_control(ctx, "reload", dry_run=True, config=raw))
    refused = [ch for ch, v in (data.get("risk") or {}).items() if not v["accepted"]]
    if as_json:
        _emit_json(data)
    else:
        out.print(f"ok {found}: {len(cfg.channels)} channels, {len(cfg.models)} models", highlight=False, markup=False)
        if risk:
            print_plan(data)
            if not data.get("changes"):
                out.print("no channel setting differs from what the daemon runs", highlight=False)
    if refused:
        raise typer.Exit(1)


@app.command("config")
def show_config(ctx: typer.Context) -> None:
    """Print the configuration the daemon runs with, as JSON."""
    _emit_json(_control(ctx, "config"))


@app.command()
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
    status_before = _control(ctx, "status") if wait else None
    data = _control(ctx, "warmup", top_users=top_users, **({"model": model} if model else {}))
    if not data.get("queued") and not data.get("already_cached"):
        if as_json:
            _emit_json(data)
        reason = data.get("reason") or "no warmup plugin named any input (the daemon's log says why)"
        raise fail(f"nothing to warm up: {reason}", 1)
    if not as_json:
        out.print(f"queued {data['queued']} inputs for warmup in channel {data.get('channel', '?')} "
                  f"({data['already_cached']} already cached, backlog {data['backlog']})", highlight=False)
    if wait:
        channel = data["channel"]
        data["warmed"] = done = follow(lambda cmd: _control(ctx, cmd), channel, data["queued"],
                                       warmed(status_before, channel),
                                       Console(stderr=True) if as_json else out) if data["queued"] else 0
        if not as_json:
            out.print(f"warmed {done} of {data['queued']} inputs", highlight=False)
    if as_json:
        _emit_json(data)


@app.command()
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
    data = _control(ctx, "forget", user=user, **({"tenant": tenant} if tenant is not None else {}))
    if as_json:
        _emit_json(data)
        return
    out.print(f"erased {data['sketch_users']} user record(s) with {data['sketch_inputs']} input(s) from the "
              f"top-users sketch{' (file rewritten)' if data.get('file_rewritten') else ''}, "
              f"{data['cache_entries']} result-cache entr{'y' if data['cache_entries'] == 1 else 'ies'}, "
              f"{data['warmup_inputs']} warmup input(s)", highlight=False, markup=False)


@app.command()
def stop(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help='Print {"state": "draining"}.')
         ) -> None:
    """Drain and stop the daemon (same as SIGTERM)."""
    data = _control(ctx, "stop")
    if as_json:
        _emit_json(data)
    else:
        out.print(data.get("state", "draining") if isinstance(data, dict) else "draining", highlight=False)


@app.command()
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
    except FileExistsError as exc:
        raise fail(exc.strerror or str(exc), 1) from None
    except ValueError as exc:
        raise fail(str(exc), 2) from None
    except OSError as exc:
        raise fail(f"{where}: cannot write: {exc.strerror or exc}", 1) from None
    if as_json:
        _emit_json({"public_key": public, "public_file": str(public_file), "secret_file": str(secret_file)})
        return
    out.print(f"public key {public}\n  {public_file} (give it to the other side)\n"
              f"  {secret_file} (mode 0600: keep it here)", highlight=False, markup=False)


from dynbatchd.cli.httpkey import app as http_key_app  # noqa: E402

app.command("plan")(plan)
app.command("simulate")(simulate)
app.command("capacity")(capacity)
app.command("recommend")(recommend)
app.command("tune")(tune)
app.command("bench")(bench)
app.add_typer(http_key_app, name="http-key")   # the HTTP door's API keys (dynbatchd/cli/httpkey.py)


def main() -> None:
    app()
