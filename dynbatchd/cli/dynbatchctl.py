"""`dynbatchctl`: talk to a running dynbatchd. Rich tables for people, --json for scripts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import typer
from rich.console import Console, Group
from rich.markup import escape
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from dynbatchd.cli import ops, output as cli_output, reload as reload_commands
from dynbatchd.cli.bench import bench
from dynbatchd.cli.capacity import capacity
from dynbatchd.cli.output import (NOT_RUNNING, JsonOption, OneLineErrors, emit_json, err, exit_code,  # noqa: F401
                                  fail, out)
from dynbatchd.cli.plan import plan
from dynbatchd.cli.recommend import recommend
from dynbatchd.cli.reload import print_plan  # noqa: F401 - the reload's printing, also named here
from dynbatchd.cli.simulate import simulate
from dynbatchd.cli.target import Target, user_keys_dir  # noqa: F401
from dynbatchd.cli.tune import tune
from dynbatchd.cli.views import (CHANNEL_COLUMNS, DEVICE_COLUMNS, _limit_text, compliance_view,  # noqa: F401
                                 fitted_table, status_view)
from dynbatchd.client import Client, DynbatchdError, NotRunning, check_running, control_call

app = typer.Typer(help="Control and query a running dynbatchd.", no_args_is_help=True, add_completion=False,
                  cls=OneLineErrors)


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
    # control_call looked up here when called, so a test may replace dynbatchctl.control_call
    ctx.obj = Target(endpoint, control, config, curve_key, server_key,
                     control_call=lambda *a, **k: control_call(*a, **k))


def _control(ctx: typer.Context, cmd: str, **args: Any) -> Any:
    return cli_output.control(ctx, cmd, **args)


_emit_json = emit_json


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
          stream: bool = typer.Option(False, "--stream", help="A generative (causal-lm) model: print the text as it "
                                                              "is generated; with --json, each frame as a JSON line."),
          max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1,
                                                       help="A generative model: at most this many new tokens."),
          as_json: bool = JsonOption) -> None:
    """Send one text to MODEL and print its output (a long vector summarised) with the timing."""
    try:
        check_running(ctx.obj.endpoint)
    except NotRunning as exc:
        raise fail(str(exc), NOT_RUNNING) from None
    client = Client(ctx.obj.endpoint, timeout=timeout, **ctx.obj.curve_args(ctx.obj.endpoint))
    generate = {"max_new_tokens": max_new_tokens} if max_new_tokens is not None else None
    if stream:
        try:
            ops.stream_infer(client, model, text, as_json, timeout, ctx.obj.endpoint, tags=tag,
                             deadline_ms=deadline_ms, request_type=request_type, user_frequency=user_frequency,
                             tokens=tokens, generate=generate)
        finally:
            client.close()
        return
    try:
        result = client.infer_result(model, text, tags=tag, deadline_ms=deadline_ms, request_type=request_type,
                                     user_frequency=user_frequency, tokens=tokens, generate=generate)
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
    generated = isinstance(output, dict) and "finish_reason" in output   # a generative model's whole answer
    if generated:
        timing.update(ttft_ms=t.ttft_us / 1000, tpot_ms=t.tpot_us / 1000, preemptions=t.preemptions)
    if as_json:
        _emit_json({"id": result.id, "output": output, "timing": timing})
        return
    if generated:
        out.print(output.get("text", ""), highlight=False, markup=False)
        out.print(f"{output['finish_reason']}: {output.get('output_tokens', '?')} tokens (prompt "
                  f"{output.get('prompt_tokens', '?')}), channel {t.channel}; time to first token "
                  f"{timing['ttft_ms']:.1f} ms, per output token {timing['tpot_ms']:.2f} ms, total "
                  f"{timing['total_ms']:.1f} ms", highlight=False, markup=False)
        return
    summary = output_summary(result.output)
    out.print(Text.assemble((model, "bold"), " output: ", summary[0]))
    for line in summary[1:]:
        out.print(Text(line))
    label = " [yellow](SIMULATED device)[/yellow]" if t.simulated else ""
    out.print(f"channel {escape(t.channel)} on {escape(t.device)}, batch size {t.batch_size}{label}:\n"
              f"  queue {timing['queue_ms']:.2f} ms, compute {timing['compute_ms']:.2f} ms, "
              f"total {timing['total_ms']:.2f} ms", highlight=False)


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
                                                "run-alone decisions per rule, the latest ones, the audit log "
                                                "(an admin key's, where the control socket has CURVE keys).")
           ) -> None:
    """Per-channel queues and batching, per-device workers (fits the terminal; --wide shows all)."""
    data = _control(ctx, "status")
    if compliance:
        if "compliance" not in data:   # a client key's status: the daemon withholds the audit
            raise fail("status --compliance needs an admin key: the daemon shows the compliance audit "
                       "(other tenants' refusals) only to keys in keys_dir/admins/, and this key is a "
                       "client's", 1)
        summary = data["compliance"] or {"decisions": [], "recent": [], "audit_log": None}
        if as_json:
            _emit_json(summary)
        else:
            out.print(compliance_view(summary))
        return
    if as_json:
        _emit_json(data)
        return
    if watch is None or once:
        _print_status(status_view(data, out, wide=wide), wide)
        return
    try:
        if not out.is_terminal:   # a pipe or a log: no cursor tricks, one frame per interval
            while True:
                out.print(Text(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}", style="dim"))
                _print_status(status_view(data, out, wide=wide), wide)
                time.sleep(watch)
                data = _control(ctx, "status")
        with Live(status_view(data, out, wide=wide), console=out, refresh_per_second=4) as live:
            while True:
                time.sleep(watch)
                live.update(status_view(_control(ctx, "status"), out, wide=wide))
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


from dynbatchd.cli.httpkey import app as http_key_app  # noqa: E402

app.command()(reload_commands.reload)
app.command("check-config")(reload_commands.check_config)
app.command("config")(reload_commands.show_config)
app.command()(ops.warmup)
app.command()(ops.forget)
app.command()(ops.stop)
app.command()(ops.keygen)

app.command("plan")(plan)
app.command("simulate")(simulate)
app.command("capacity")(capacity)
app.command("recommend")(recommend)
app.command("tune")(tune)
app.command("bench")(bench)
app.add_typer(http_key_app, name="http-key")   # the HTTP door's API keys (dynbatchd/cli/httpkey.py)


def main() -> None:
    app()
