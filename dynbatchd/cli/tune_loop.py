"""`dynbatchctl tune --auto`: the tuning loop, one channel at a time (collect, fit, search on the
simulator, assess the risk, canary, promote or roll back), and its report."""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

import typer
from rich.markup import escape

from dynbatchd import config as cfgmod
from dynbatchd.cli.output import err, fail, out
from dynbatchd.cli.tables import fit_table, show
from dynbatchd.cli.tune_daemon import _call, _channel_now, _database, _loop_settings, _note, _running


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
