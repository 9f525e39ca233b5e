"""`dynbatchctl tune`: set a channel by hand, or let the tuning loop do it and keep the record.

By hand: ``tune CHANNEL --window-ms 20``. ``--auto [CHANNEL]``: the loop of
`dynbatchd.tuning`, one channel at a time: collect the daemon's observations
(refusing when they are too few), fit the channel's model, search settings on
the simulator (or take ``--candidate``), assess the risk on recent and burst
traffic, run a canary against the incumbent on a replay of the channel's
traffic, then promote or roll back. The canary runs in the daemon on a share
of the channel's live traffic (``--canary live``, the default), on copies of
it whose results are discarded (``--canary shadow``), or on the simulator
replaying the channel's traffic (``--canary replay``). A live canary that
the daemon judges bad is rolled back by the daemon itself, even if this
command is gone. ``--history`` shows every step. Every predicted figure (and
a replayed canary's) is SIMULATED.

Whatever changes a channel (a manual tune, a promotion) the daemon checks with
the same risk assessment (``--dry-run`` prints it and changes nothing,
``--force`` applies a refused change, logged as forced) and writes to its
tuning drop-in (STATE_DIR/overrides.toml), so it survives reload and restart;
``--rollback CHANNEL`` takes the last change back, one step at a time, down to
the config file's value.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dynbatchd.cli.tables import WIDE_HELP, fit_table, show

from dynbatchd import config as cfgmod
from dynbatchd.client import DynbatchdError
from dynbatchd.tuning import history
from dynbatchd.tuning.store import connect, database_path

out = Console()
err = Console(stderr=True, soft_wrap=True)

TUNE_HELP = {
    "max_batch": "Largest batch cut from the channel (1 to 65536).",
    "window_ms": "Longest wait for a batch to fill, in ms (0 to the channel's deadline).",
    "deadline_ms": "Default deadline of the channel's requests, in ms (> 0, at most one day).",
    "queue_limit": "Requests the channel may hold before answering overloaded (1 to 16777216).",
    "max_tokens": "Cap on the tokens of one batch (0: none).",
    "min_share": "Share of dispatches the channel is guaranteed under overload (0 to 1).",
}
LOOP_KEYS = ("max_batch", "window_ms", "window")   # what the loop changes, and what a rollback restores


def fail(message: str, code: int) -> typer.Exit:
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _call(ctx: typer.Context, cmd: str, **args: Any) -> Any:
    from dynbatchd.cli import dynbatchctl   # its control_call, the one a test replaces

    try:
        return dynbatchctl.control_call(ctx.obj.control, cmd, **ctx.obj.curve_args(ctx.obj.control), **args)
    except DynbatchdError as exc:
        raise fail(str(exc), dynbatchctl.exit_code(exc)) from None


def _channel_now(ctx: typer.Context, channel: str) -> dict[str, Any] | None:
    """The channel's running loop settings for the history, or None, quietly: not knowing them
    never stops a tune (nor adds a line to its error, e.g. the refusal of an admin's command)."""
    from dynbatchd.cli import dynbatchctl

    keys = ctx.obj.curve_args(ctx.obj.control)   # a key that will not load: its one line, here
    try:
        found = dynbatchctl.control_call(ctx.obj.control, "config", **keys).get("channels", {}).get(channel)
    except Exception:   # noqa: BLE001 - only the history's "before" is lost
        return None
    return _loop_settings(found) if found else None


def _database(ctx: typer.Context):
    """The tuning database of this host's config (``[daemon] state_dir``)."""
    path = cfgmod.find_config(ctx.obj.config)
    try:
        daemon = cfgmod.load(path).daemon if path is not None else cfgmod.DaemonSettings()
        return connect(database_path(daemon))
    except cfgmod.ConfigError as exc:
        raise fail(str(exc), 2) from None
    except OSError as exc:
        raise fail(f"the tuning database: {exc.strerror or exc}", 1) from None


def _running(ctx: typer.Context) -> cfgmod.Config:
    raw = _call(ctx, "config")
    raw.pop("source", None)
    return cfgmod.parse(raw, "running config")


def _loop_settings(channel: dict[str, Any]) -> dict[str, Any]:
    return {k: channel.get(k) for k in LOOP_KEYS}


def parse_candidate(text: str) -> dict[str, Any]:
    """``max_batch=64,window_ms=900[,policy=slo]`` -> a dict (one clear error otherwise)."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key not in ("max_batch", "window_ms", "policy"):
            raise ValueError(f"--candidate takes max_batch=N,window_ms=F[,policy=NAME]; not {part!r}")
        out[key] = int(value) if key == "max_batch" else float(value) if key == "window_ms" else value
    if "max_batch" not in out or "window_ms" not in out:
        raise ValueError("--candidate needs both max_batch and window_ms")
    return out


def tune(ctx: typer.Context,
         channel: Optional[str] = typer.Argument(None, help="The channel (with --auto: only this one)."),
         max_batch: Optional[int] = typer.Option(None, help=TUNE_HELP["max_batch"]),
         window_ms: Optional[float] = typer.Option(None, help=TUNE_HELP["window_ms"]),
         deadline_ms: Optional[float] = typer.Option(None, help=TUNE_HELP["deadline_ms"]),
         queue_limit: Optional[int] = typer.Option(None, help=TUNE_HELP["queue_limit"]),
         max_tokens: Optional[int] = typer.Option(None, help=TUNE_HELP["max_tokens"]),
         min_share: Optional[float] = typer.Option(None, help=TUNE_HELP["min_share"]),
         auto: bool = typer.Option(False, "--auto", help="Run the tuning loop (collect, fit, search, risk, "
                                   "canary, promote or roll back) on CHANNEL, else on every busy channel."),
         candidate: Optional[str] = typer.Option(None, "--candidate", metavar="max_batch=N,window_ms=F",
                                                 help="With --auto: assess and canary this setting instead "
                                                      "of searching (e.g. to test the safeguards)."),
         trials: int = typer.Option(30, "--trials", min=1, help="With --auto: simulated settings to try."),
         duration: float = typer.Option(20.0, "--duration", min=1.0,
                                        help="With --auto: seconds of the channel's traffic each trial replays."),
         target: float = typer.Option(0.99, "--target", min=0.0, max=1.0,
                                      help="With --auto: the on-time share a setting must keep (the SLO)."),
         risk_threshold: float = typer.Option(0.02, "--risk-threshold", min=0.0, max=1.0,
                                              help="With --auto: on-time share a candidate may lose to the "
                                                   "incumbent on x1.5 / x2 bursts before it is refused."),
         canary_share: float = typer.Option(0.1, "--canary-share", min=0.01, max=0.5,
                                            help="With --auto: share of the channel's traffic the candidate serves."),
         canary_seconds: float = typer.Option(10.0, "--canary-seconds", min=1.0,
                                              help="With --auto: how long the canary runs."),
         canary_mode: str = typer.Option("live", "--canary", metavar="live|shadow|replay",
                                         help="With --auto: the candidate serves its share of the live "
                                              "traffic (live), runs copies of it whose results are "
                                              "discarded (shadow), or is judged on a SIMULATED replay."),
         seed: int = typer.Option(1, "--seed", help="With --auto: random seed (the loop is deterministic)."),
         window: float = typer.Option(10.0, "--window", min=0.0,
                                      help="With --auto: seconds of live traffic to observe (status read at "
                                           "its start and end; 0: the daemon's rate meter)."),
         show_history: bool = typer.Option(False, "--history", help="Show the tuning history (of CHANNEL, "
                                           "else of all) instead of changing anything."),
         rollback: bool = typer.Option(False, "--rollback", help="Take back CHANNEL's last change (manual or "
                                       "promoted): one step back, down to the config file's value."),
         force: bool = typer.Option(False, "--force", help="Apply a setting even if the risk assessment refuses "
                                    "it (the daemon logs that it was forced)."),
         dry_run: bool = typer.Option(False, "--dry-run", help="Print what the setting would change and the "
                                      "risk verdict; change nothing."),
         wide: bool = typer.Option(False, "--wide", help=WIDE_HELP),
         as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts instead of text.")) -> None:
    """Change a channel's batching at run time, or tune it with --auto (checked like a config file
    and by the risk assessment; kept in the daemon's tuning drop-in across reload and restart).

    \b
    Examples:
      dynbatchctl tune realtime --window-ms 20 --max-batch 8
      dynbatchctl tune realtime --window-ms 20 --dry-run
      dynbatchctl tune --auto standard
      dynbatchctl tune --auto standard --candidate max_batch=64,window_ms=900
      dynbatchctl tune --history
      dynbatchctl tune --rollback standard
    """
    changes = {k: v for k, v in dict(max_batch=max_batch, window_ms=window_ms, deadline_ms=deadline_ms,
                                      queue_limit=queue_limit, max_tokens=max_tokens, min_share=min_share).items()
               if v is not None}
    modes = [m for m, on in (("--auto", auto), ("--history", show_history), ("--rollback", rollback),
                             ("a setting", bool(changes))) if on]
    if len(modes) > 1:
        raise fail(f"give one of --auto, --history, --rollback or settings; not {' and '.join(modes)}", 2)
    if show_history:
        return _show_history(ctx, channel, as_json)
    if channel is None and not auto:
        raise fail("name the channel, e.g. dynbatchctl tune standard --window-ms 20", 2)
    if rollback:
        return _rollback(ctx, channel, as_json)
    if auto:
        try:
            wanted = parse_candidate(candidate) if candidate else None
        except ValueError as exc:
            raise fail(str(exc), 2) from None
        if canary_mode not in ("live", "shadow", "replay"):
            raise fail(f"--canary is live, shadow or replay; not {canary_mode!r}", 2)
        return run_loop(ctx, channel, wanted, dict(trials=trials, duration=duration, target=target,
                                                    threshold=risk_threshold, share=canary_share,
                                                    seconds=canary_seconds, seed=seed, window=window,
                                                    canary=canary_mode, wide=wide), as_json)
    if not changes:
        raise fail("give at least one setting, e.g. --window-ms 20 (or --auto, --history, --rollback)", 2)
    try:   # the ranges of a config file, here, so a value msgpack cannot even carry is one clear line
        cfgmod.check_channel_values(channel, changes)
    except cfgmod.ConfigError as exc:
        raise fail(f"refused: {exc.key}: {exc.rule}", 2) from None
    if dry_run:
        return _dry_run(ctx, channel, changes, as_json)
    before = _channel_now(ctx, channel)
    data = _call(ctx, "tune", channel=channel, **changes, **({"force": True} if force else {}))
    settings = data.get("settings", data)   # (a daemon before the drop-in answered the settings alone)
    _note(ctx, channel, "manual", "set by hand: " + ", ".join(f"{k}={v}" for k, v in changes.items()),
          before=before, after=_loop_settings(settings))
    if as_json:   # the channel's settings at the top, as before the drop-in, and what the daemon said
        _emit({**settings, **{k: v for k, v in data.items() if k != "settings"}})
        return
    out.print(f"channel [bold]{escape(channel)}[/bold] now: " + ", ".join(f"{k}={settings[k]}" for k in changes),
              highlight=False)
    if data.get("verdict"):
        out.print(("[yellow]FORCED[/yellow] past the risk assessment: " if data.get("forced") else "risk: ")
                  + escape(data["verdict"]), highlight=False)


def _emit(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _dry_run(ctx: typer.Context, channel: str, changes: dict[str, Any], as_json: bool) -> None:
    """`tune CHANNEL ... --dry-run`: the daemon's plan and risk verdict; nothing changes. Exit 1 when refused."""
    data = _call(ctx, "tune", channel=channel, dry_run=True, **changes)
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        out.print(f"channel [bold]{escape(channel)}[/bold] would change: " + ", ".join(
            f"{k} {data['before'].get(k)} -> {v}" for k, v in data["after"].items()) + " (dry run: nothing changed)",
            highlight=False)
        out.print(f"risk {escape(data['verdict'])}", highlight=False)
    if not data["risk"]["accepted"]:
        raise typer.Exit(1)


def _note(ctx: typer.Context, channel: str, step: str, reason: str, **kw: Any) -> None:
    """Record a step; a history that cannot be written is a warning, never a lost tune."""
    try:
        with _database(ctx) as db:
            history.record(db, channel, step, reason, **kw)
    except (typer.Exit, OSError, Exception) as exc:   # noqa: BLE001 - the tune itself has happened
        err.print(f"[yellow]warning:[/yellow] not recorded in the tuning history: {escape(str(exc))}", highlight=False, soft_wrap=True)


def _show_history(ctx: typer.Context, channel: str | None, as_json: bool) -> None:
    with _database(ctx) as db:
        steps = history.rows(db, channel)
    if as_json:
        sys.stdout.write(json.dumps(steps, indent=2, default=str) + "\n")
        return
    if not steps:
        out.print("no tuning steps recorded" + (f" for channel {escape(channel)}" if channel else ""), highlight=False)
        return
    table = Table(title="tuning history (predicted and canary figures SIMULATED)")
    for col in ("when (UTC)", "channel", "step", "settings", "reason"):
        table.add_column(col, overflow="fold")
    for s in steps:
        settings = s["after"] or (s["figures"] or {}).get("candidate_settings") or {}
        shown = ", ".join(f"{k}={v}" for k, v in settings.items() if v is not None)
        table.add_row(time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s["at"])), s["channel"], s["step"], shown,
                      s["reason"])
    out.print(table)


def _rollback(ctx: typer.Context, channel: str, as_json: bool) -> None:
    """One step back, by the daemon from its drop-in (which knows every change, whoever made it)."""
    before = _channel_now(ctx, channel)
    data = _call(ctx, "tune", channel=channel, rollback=True)
    settings = data.get("settings", data)
    _note(ctx, channel, "restore", "restored by tune --rollback", before=before, after=_loop_settings(settings))
    if as_json:
        _emit({**settings, **{k: v for k, v in data.items() if k != "settings"}})
    else:
        restored = data.get("after") or {k: settings.get(k) for k in LOOP_KEYS}
        out.print(f"channel [bold]{escape(channel)}[/bold] restored: "
                  + ", ".join(f"{k}={v}" for k, v in restored.items()), highlight=False)


# -- the loop ---------------------------------------------------------------------

def run_loop(ctx: typer.Context, channel: str | None, wanted: dict[str, Any] | None, opts: dict[str, Any],
             as_json: bool) -> None:
    """`tune --auto`: each named (else each busy) channel through the loop, one after another."""
    from dynbatchd.plugins import Plugins   # optuna and the simulator only when asked for

    from dynbatchd.tuning.collector import over_window

    status, cfg = _call(ctx, "status"), _running(ctx)
    if opts.get("window", 0) > 0:   # a measurement window, not a wait for something to happen
        started = time.monotonic()
        time.sleep(opts["window"])
        status = over_window(status, _call(ctx, "status"), time.monotonic() - started)
    if channel is not None and channel not in cfg.channels:
        raise fail(f"no channel named {channel!r}", 1)
    names = [channel] if channel else [n for n in cfg.channels
                                       if status["channels"].get(n, {}).get("arrival_rps", 0.0) > 0]
    if not names:
        raise fail("no channel has traffic in the last seconds; run tune --auto under traffic", 1)
    plugins = Plugins.load()
    reports = []
    for name in names:
        reports.append(_tune_one(ctx, cfg, status, name, wanted, opts, plugins))
        cfg = _running(ctx)   # the next channel is tuned with this one as it now runs
    if as_json:
        sys.stdout.write(json.dumps({"simulated": True, "channels": reports}, indent=2, default=str) + "\n")
    else:
        for r in reports:
            _print_report(r, opts.get("wide", False))
    if channel is not None and reports[0]["outcome"] == "not_enough_data":
        raise typer.Exit(1)


def _tune_one(ctx: typer.Context, cfg: cfgmod.Config, status: dict[str, Any], name: str,
              wanted: dict[str, Any] | None, opts: dict[str, Any], plugins: Any) -> dict[str, Any]:
    import dataclasses

    from dynbatchd.tuning import analyzer, canary as canaries, collector, recommender, risk

    report: dict[str, Any] = {"channel": name}
    try:
        observation = collector.collect(status, name)
    except collector.NotEnoughData as exc:
        return {**report, "outcome": "not_enough_data", "reason": str(exc)}
    model = analyzer.fit(observation, opts["duration"], opts["seed"])
    evaluate = recommender.Evaluator(cfg, model, plugins)
    incumbent = recommender.Setting.of(cfg.channels[name])
    now = evaluate(incumbent)
    report.update(observation=observation.as_dict(), incumbent=incumbent.as_dict(),
                  incumbent_predicted=now.as_dict() if now else None,
                  fit_error=analyzer.fit_error(observation, now.on_time, now.p99_ms) if now else None)
    report["bench_fit_error"] = _bench_fit(ctx, evaluate, name)
    if wanted is not None:
        chosen = recommender.Setting(wanted["max_batch"], wanted["window_ms"], wanted.get("policy", incumbent.policy))
        source = "planted with --candidate"
        predicted = evaluate(chosen)
    else:
        chosen, predicted, _, _ = recommender.search(evaluate, opts["trials"], opts["seed"], opts["target"])
        source = f"best of {opts['trials']} simulated trials"
    report.update(candidate=chosen.as_dict(), candidate_predicted=predicted.as_dict() if predicted else None)
    if chosen == incumbent:
        reason = f"the running setting is the best found ({source})"
        _note(ctx, name, "proposal", reason, after=chosen.as_dict(), figures=report)
        return {**report, "outcome": "kept", "reason": reason}
    _note(ctx, name, "proposal", source, before=incumbent.as_dict(), after=chosen.as_dict(),
          figures={"candidate": report["candidate_predicted"], "incumbent": report["incumbent_predicted"],
                   "fit_error": report["fit_error"], "observation": report["observation"]})
    assessment = risk.assess(evaluate, chosen, target=opts["target"], threshold=opts["threshold"])
    report["risk"] = assessment.as_dict()
    if not assessment.accepted:
        _note(ctx, name, "refused", assessment.reason, after=chosen.as_dict(), figures=assessment.predicted)
        return {**report, "outcome": "refused", "reason": assessment.reason}
    _note(ctx, name, "risk", assessment.reason, after=chosen.as_dict(), figures=assessment.predicted)
    too_few = canary_too_small(observation.arrival_rps, opts["share"], opts["seconds"])
    if too_few:   # the canary could only roll back: say why now, instead of running it for nothing
        _note(ctx, name, "refused", too_few, after=chosen.as_dict())
        return {**report, "outcome": "too_little_traffic", "reason": too_few}
    window = recommender.apply(cfg, name, chosen).channels[name].window
    changes = dict(max_batch=chosen.max_batch, window_ms=chosen.window_ms,
                   window=cfgmod.to_dict(window) if window is not None else None)
    before = _loop_settings(cfgmod.to_dict(cfg.channels[name]))
    if opts["canary"] == "replay":
        canary = canaries.Canary(opts["share"], int(opts["seconds"] * 1e9), 0)
        replayed = dataclasses.replace(model, duration_s=opts["seconds"], seed=opts["seed"] + 1)
        verdict, _ = canaries.replay(canary, name, cfg.channels[name], evaluate.config_for(chosen).channels[name],
                                     replayed.traffic(), replayed, **evaluate.kw)
        report["canary"] = {"action": verdict.action, "reason": verdict.reason, **verdict.figures,
                            "mode": "replay", "simulated": True}
    else:
        report["canary"] = {**_live_canary(ctx, name, changes, opts), "mode": opts["canary"], "simulated": False}
    action, reason = report["canary"]["action"], report["canary"]["reason"]
    _note(ctx, name, "canary", f"{action}: {reason}", after=chosen.as_dict(), figures=report["canary"])
    if action != canaries.PROMOTE:
        _note(ctx, name, "rollback", reason, before=chosen.as_dict(), after=incumbent.as_dict())
        return {**report, "outcome": "rolled_back", "reason": reason}
    if opts["canary"] == "replay":   # a live canary's promotion is the daemon's own
        _call(ctx, "tune", channel=name, force=True, why=f"promoted by tune --auto: {reason}", **changes)
    _note(ctx, name, "promote", reason, before=before, after=_channel_now(ctx, name), figures=report["canary"])
    return {**report, "outcome": "promoted", "reason": reason}


def canary_too_small(rate_rps: float, share: float, seconds: float) -> str | None:
    """Why a canary of `share` of `rate_rps` for `seconds` cannot promote (its candidate would answer
    fewer requests than `canaries.MIN_ANSWERED`, the fewest it judges on), and how to give it enough;
    None when it can."""
    from dynbatchd.tuning.canary import MIN_ANSWERED

    expected = rate_rps * share * seconds
    if expected >= MIN_ANSWERED:
        return None
    need_s = math.ceil(MIN_ANSWERED * 1.2 / (rate_rps * share)) if rate_rps > 0 else math.inf
    need_share = MIN_ANSWERED * 1.2 / (rate_rps * seconds) if rate_rps > 0 else math.inf
    fix = f"--canary-seconds {need_s}" if math.isfinite(need_s) else "more traffic"
    if need_share <= 0.5:
        fix += f" or --canary-share {math.ceil(need_share * 100) / 100:g}"
    return (f"the canary needs {MIN_ANSWERED} answered requests to judge, and {100 * share:g}% of "
            f"{rate_rps:.3g} req/s for {seconds:g} s gives it about {expected:.0f}: it cannot promote below "
            f"{MIN_ANSWERED / (share * seconds):.3g} req/s with these settings; give it {fix}")


def _live_canary(ctx: typer.Context, name: str, changes: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """Start the canary in the daemon and follow it to its verdict (the daemon promotes or rolls back
    by itself; Ctrl-C here stops it as a rollback)."""
    # force: the loop has just assessed this candidate on the window it measured; the daemon assesses
    # it again for its log and the drop-in's trail, and says so if it would have refused it
    _call(ctx, "canary", action="start", channel=name, share=opts["share"], seconds=opts["seconds"],
          shadow=opts["canary"] == "shadow", force=True, **changes)
    give_up = time.monotonic() + opts["seconds"] + 60   # the judge ends it on time; this is a backstop
    try:
        with err.status(f"canary of {escape(name)}: {100 * opts['share']:g}% of its live traffic for "
                        f"{opts['seconds']:g} s") as shown:
            while True:
                state = _call(ctx, "canary")
                if name in state["ended"] and name not in state["running"]:
                    return state["ended"][name]
                if time.monotonic() > give_up:
                    return _call(ctx, "canary", action="stop", channel=name)["ended"][name]
                now = state["running"].get(name)
                if now:
                    shown.update(f"canary of {escape(name)}: {now['seconds']:.0f}/{now['duration_s']:g} s, candidate "
                                 f"on time {100 * now['candidate']['on_time']:.2f}% of {now['candidate']['answered']}, "
                                 f"running setting {100 * now['incumbent']['on_time']:.2f}%")
                time.sleep(0.5)   # a human-scale refresh while the daemon judges
    except KeyboardInterrupt:
        stopped = _call(ctx, "canary", action="stop", channel=name)["ended"][name]
        _note(ctx, name, "rollback", "canary stopped by Ctrl-C", after=_channel_now(ctx, name), figures=stopped)
        raise


def _bench_fit(ctx: typer.Context, evaluate: Any, name: str) -> dict[str, Any] | None:
    """The model against this channel's live `bench` cells, if any (see analyzer.cells_error)."""
    import dataclasses

    from dynbatchd.tuning import analyzer, cells, recommender

    try:
        with _database(ctx) as db:
            found = cells.query(db, channel=name, simulated=False, limit=50)
    except Exception:   # noqa: BLE001 - no bench table (or an unreadable one): the fit stands on status alone
        return None

    def run_setting(max_batch: int, window_ms: float, policy: str, rate: float) -> tuple[float, float]:
        model = dataclasses.replace(evaluate.model, rate_rps=rate)
        again = recommender.Evaluator(evaluate.cfg, model, evaluate.plugins)
        sc = again(recommender.Setting(max_batch, window_ms, policy))
        return (sc.on_time, sc.p99_ms) if sc is not None else (0.0, 0.0)
    return analyzer.cells_error(evaluate.model, found, run_setting)


def _print_report(r: dict[str, Any], wide: bool = False) -> None:
    name = escape(r["channel"])
    if r["outcome"] == "not_enough_data":
        # a refusal (exit 1), one line as every error is, however narrow the terminal
        out.print(f"[bold]{name}[/bold]: not tuned: {escape(r['reason'])}", highlight=False, soft_wrap=True)
        return
    fe = r.get("fit_error") or {}
    inc, cand = r.get("incumbent_predicted") or {}, r.get("candidate_predicted") or {}
    out.print(f"[bold]{name}[/bold] [yellow]SIMULATED[/yellow]: observed {r['observation']['arrival_rps']:g} req/s, "
              f"{r['observation']['mean_tokens']:g} tokens; model fit error on time "
              f"{100 * fe.get('on_time_error', 0):.2f} points, p99 {100 * fe.get('p99_relative_error', 0):.0f}%"
              + (f"; against {r['bench_fit_error']['cells']} live bench cells: on time "
                 f"{100 * r['bench_fit_error']['on_time_error']:.2f} points" if r.get("bench_fit_error") else ""),
              highlight=False)
    columns = [("", 0), ("batch", 0), ("window ms", 0), ("policy", 1), ("on time", 0), ("on-time rps", 2),
               ("p99 ms", 0), ("device s", 3)]
    rows = [[label, str(s["max_batch"]), f"{s['window_ms']:g}", s["policy"],
             f"{100 * p.get('on_time', 0):.2f}%" if p else "-", f"{p.get('goodput_rps', 0):.1f}" if p else "-",
             f"{p.get('p99_ms', 0):.1f}" if p else "-", f"{p.get('device_s', 0):.2f}" if p else "-"]
            for label, s, p in (("running", r["incumbent"], inc), ("proposed", r["candidate"], cand))]
    show(out, fit_table(None, columns, rows, out, wide, left={"", "policy"}, show_edge=False), wide)
    if "canary" in r:
        c = r["canary"]
        def p99(arm: dict[str, Any]) -> str:
            return f"{arm['p99_ms']:.1f} ms" if arm["p99_ms"] is not None else "over the SLO"

        where = {"replay": "SIMULATED replay", "live": "live traffic",
                 "shadow": "shadow copies of live traffic"}[c.get("mode", "replay")]
        out.print(f"  canary ({100 * c['share']:g}% for {c['seconds']:g} s, {where}): candidate on time "
                  f"{100 * c['candidate']['on_time']:.2f}%, p99 {p99(c['candidate'])}; running setting "
                  f"{100 * c['incumbent']['on_time']:.2f}%, p99 {p99(c['incumbent'])}", highlight=False)
    word = {"kept": "kept", "refused": "refused", "rolled_back": "rolled back", "promoted": "promoted",
            "too_little_traffic": "not promoted"}[r["outcome"]]
    out.print(f"  [bold]{word}[/bold]: {escape(r['reason'])}", highlight=False)
    if r["outcome"] == "promoted":
        c = r["candidate"]
        out.print(f"  kept in the daemon's tuning drop-in; to make it the file's, set max_batch = {c['max_batch']}, "
                  f"window_ms = {c['window_ms']:g} in \\[channels.{name}] of the config file", highlight=False)
