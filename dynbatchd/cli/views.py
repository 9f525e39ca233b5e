"""The status screen of dynbatchctl: the channel and device tables fitted to the terminal, the
canaries, the tuning overrides, the cache, and the compliance summary (`status --compliance`)."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from dynbatchd.cli.output import out


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


def _scheduling(passes: dict[str, Any] | None) -> str:
    """How long the passes that cut batches take, where any did (a device waits for one slower
    than the queue lead)."""
    if not passes or not passes.get("passes"):
        return ""
    return (f"  plans {passes['mean_ms']:.2f} ms mean, {passes['over_lead']} of {passes['passes']} over the "
            f"{passes['lead_ms']:g} ms lead")


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
                                      f"  health {d['health']['score']:.2f}" if "health" in d else "",
                                      _scheduling(d.get("scheduling")))]
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
    parts += [Text(line) for line in generation_lines(data.get("generation"))]
    return Group(*parts)


def generation_lines(gen: dict[str, Any] | None) -> list[str]:
    """`generation: 2 running, 812 KV tokens in use`, then per channel its tokens and TTFT/TPOT
    p50/p99; nothing for a daemon that has generated nothing."""
    if not gen or not (gen.get("running") or gen.get("ended")):
        return []
    ended = ", ".join(f"{n} {reason}" for reason, n in sorted(gen.get("ended", {}).items()))
    lines = [f"generation: {gen['running']} running, {gen['kv_in_use_tokens']} KV tokens in use"
             + (f"; ended {ended}" if ended else "")]
    ttft, tpot = gen.get("ttft", {}), gen.get("tpot", {})
    for channel, tokens in sorted(gen.get("generated_tokens", {}).items()):
        line = f"  {channel}: {tokens} tokens generated"
        if channel in ttft:
            line += f", first token p50 {ttft[channel]['p50_ms']:.1f} / p99 {ttft[channel]['p99_ms']:.1f} ms"
        if channel in tpot:
            line += f", per token p50 {tpot[channel]['p50_ms']:.2f} / p99 {tpot[channel]['p99_ms']:.2f} ms"
        lines.append(line)
    return lines


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
