"""Prometheus exposition of the daemon's status, on a tiny asyncio HTTP endpoint.

Enabled with ``[daemon] metrics_listen = "127.0.0.1:9464"``. Serves
``GET /metrics`` in the text format (version 0.0.4); anything else is 404.
Only counts, sizes and times are exported: never payloads.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

log = logging.getLogger(__name__)

_CHANNEL_COUNTERS = (
    ("accepted", "dynbatchd_requests_accepted_total", "Requests admitted to the channel's queue."),
    ("completed", "dynbatchd_requests_completed_total", "Requests answered with a result."),
    ("expired", "dynbatchd_requests_expired_total", "Requests answered deadline_exceeded without running."),
    ("late", "dynbatchd_requests_late_total", "Requests answered with a result after their deadline."),
    ("failed", "dynbatchd_requests_failed_total", "Requests answered model_error or shutting_down."),
    ("batches", "dynbatchd_batches_total", "Batches dispatched to devices."),
)
_CHANNEL_GAUGES = (
    ("queue_depth", "dynbatchd_queue_depth", "Requests waiting in the channel."),
    ("max_batch", "dynbatchd_max_batch", "Current batch-size limit."),
    ("mean_batch", "dynbatchd_batch_size_mean", "Mean dispatched batch size."),
    ("fill_rate", "dynbatchd_batch_fill_ratio", "Mean batch size over max batch size."),
    ("scheduling_efficiency", "dynbatchd_scheduling_efficiency", "Compute time / (queue wait + compute time)."),
    ("on_time", "dynbatchd_on_time_ratio", "Answered requests that met their deadline."),
)
_DEVICE_GAUGES = (
    ("inflight", "dynbatchd_device_inflight_batches", "Batches sent to the worker and not yet answered."),
    ("busy_fraction", "dynbatchd_device_busy_ratio", "Fraction of time the worker spent computing."),
    ("restarts", "dynbatchd_device_restarts", "Times the worker process was restarted."),
)


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(status: dict[str, Any], latency: dict[str, Any] | None = None) -> str:
    """Prometheus text for one status snapshot (the same data `dynbatchctl status --json` shows),
    plus each channel's lifetime latency `Histogram` as a Prometheus histogram (`latency`), so
    dashboards can take quantiles over any window with histogram_quantile()."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{{{labels}}} {value:.6g}" for labels, value in samples)

    channels = status["channels"]
    for key, name, help_text in _CHANNEL_COUNTERS:
        family(name, "counter", help_text, [(f'channel="{_esc(c)}"', s[key]) for c, s in channels.items()])
    family("dynbatchd_requests_rejected_total", "counter", "Requests refused at admission, by reason.",
           [(f'channel="{_esc(c)}",reason="{r}"', n) for c, s in channels.items() for r, n in s["rejected"].items()])
    for key, name, help_text in _CHANNEL_GAUGES:
        family(name, "gauge", help_text, [(f'channel="{_esc(c)}"', s[key]) for c, s in channels.items()])
    if latency:
        lines.append("# HELP dynbatchd_request_duration_seconds End-to-end time from acceptance to reply.")
        lines.append("# TYPE dynbatchd_request_duration_seconds histogram")
        for c, hist in latency.items():
            label = f'channel="{_esc(c)}"'
            for edge_us, count in hist.cumulative():
                lines.append(f'dynbatchd_request_duration_seconds_bucket{{{label},le="{edge_us / 1e6:.6g}"}} {count}')
            lines.append(f'dynbatchd_request_duration_seconds_bucket{{{label},le="+Inf"}} {hist.total}')
            lines.append(f"dynbatchd_request_duration_seconds_sum{{{label}}} {hist.sum_us / 1e6:.6g}")
            lines.append(f"dynbatchd_request_duration_seconds_count{{{label}}} {hist.total}")
    family("dynbatchd_latency_seconds", "gauge", "End-to-end latency quantiles over the last 30-60 s.",
           [(f'channel="{_esc(c)}",quantile="{q}"', s[f"{k}_ms"] / 1000)
            for c, s in channels.items() for q, k in (("0.5", "p50"), ("0.99", "p99"), ("0.999", "p999"))])
    traffic = [(c, s["window"].get("traffic")) for c, s in channels.items()]
    family("dynbatchd_traffic_pattern", "gauge", "Traffic class a pattern window policy sees (1 = current).",
           [(f'channel="{_esc(c)}",pattern="{_esc(str(t))}"', 1) for c, t in traffic if t])
    devices = status["devices"]
    for key, name, help_text in _DEVICE_GAUGES:
        family(name, "gauge", help_text,
               [(f'device="{_esc(d["device"])}",simulated="{str(d["simulated"]).lower()}"', d[key]) for d in devices])
    daemon = status["daemon"]
    family("dynbatchd_bad_requests_total", "counter", "Requests answered bad_request by the front end.",
           [("", daemon["bad_requests"])])
    family("dynbatchd_uptime_seconds", "gauge", "Seconds since the daemon started.", [("", daemon["uptime_s"])])
    if "health" in daemon:
        family("dynbatchd_health_score", "gauge",
               "0.4 on-time share + 0.3 min(1, deadline/p99) + 0.2 utilisation + 0.1 memory headroom.",
               [("", daemon["health"]["score"])])
    return "\n".join(line.replace("{}", "") for line in lines) + "\n"


async def serve(listen: str, page: Callable[[], str]) -> asyncio.AbstractServer:
    """Serve `page()` (Prometheus text) at GET /metrics on `listen` (HOST:PORT)."""
    host, _, port = listen.rpartition(":")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request_line.decode("latin-1").split()
            if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                body, head = page().encode(), "200 OK"
            else:
                body, head = b"not found: try /metrics\n", "404 Not Found"
            writer.write(f"HTTP/1.1 {head}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host or "127.0.0.1", int(port))
    log.info("Prometheus metrics on http://%s/metrics", listen)
    return server
