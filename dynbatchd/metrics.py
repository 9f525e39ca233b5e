"""Prometheus exposition of the daemon's status: the page (`render`); the endpoint that serves it
is `dynbatchd.metrics_endpoint` (``serve``, imported here too).

Enabled with ``[daemon] metrics_listen = "127.0.0.1:9464"``: ``GET /metrics`` in the text
format (version 0.0.4). Only counts, sizes and times are exported: never payloads.

Names follow Prometheus conventions: counters end in ``_total``, and a figure
with a unit names it (``_seconds``, ``_bytes``, ``_watts``, ``_ratio`` for
0..1). Every channel series carries ``channel``; every worker series carries
``device`` and ``simulated``; GPU series (from NVML, only where NVML answers)
carry ``device``. Series per tenant name only the busiest tenants
(`dynbatchd.tenantmetrics`), so their number stays bounded. docs/metrics.md
lists every family; grafana/dynbatchd.json is a dashboard over them.
"""

from __future__ import annotations

import math
import platform
from typing import Any, Iterable, Mapping

from dynbatchd import __version__
from dynbatchd.metrics_endpoint import HEAD_TIMEOUT_S, MAX_CONNECTIONS, serve  # noqa: F401  (the endpoint)


# (status key, metric, help): per channel, from `status["channels"][name]`.
_CHANNEL_COUNTERS = (
    ("accepted", "dynbatchd_requests_accepted_total", "Requests admitted to the channel's queue."),
    ("completed", "dynbatchd_requests_completed_total", "Requests answered with a result."),
    ("expired", "dynbatchd_requests_expired_total", "Requests answered deadline_exceeded without running."),
    ("late", "dynbatchd_requests_late_total", "Requests answered with a result after their deadline."),
    ("failed", "dynbatchd_requests_failed_total", "Requests answered model_error or shutting_down."),
    ("cache_hits", "dynbatchd_requests_cached_total", "Requests answered from the result cache (no batch)."),
    ("offered", "dynbatchd_requests_offered_total",
     "Requests answered, refused ones aside (completed, cached, expired, failed, overloaded)."),
    ("on_time_count", "dynbatchd_requests_on_time_total",
     "Requests answered successfully within their deadline (cache hits included)."),
    ("batches", "dynbatchd_batches_total", "Batches of live traffic dispatched to devices."),
    ("cost_disputed", "dynbatchd_cost_disputed_total",
     "Requests the learned cost would have refused while it overestimated the measured cost by far (not refused)."),
)
_CHANNEL_GAUGES = (
    ("queue_depth", "dynbatchd_queue_depth", "Requests waiting in the channel."),
    ("max_batch", "dynbatchd_max_batch", "Current batch-size limit."),
    ("mean_batch", "dynbatchd_batch_size_mean", "Mean dispatched batch size since start."),
    ("fill_rate", "dynbatchd_batch_fill_ratio", "Mean batch size over max batch size since start."),
    ("scheduling_efficiency", "dynbatchd_scheduling_efficiency_ratio",
     "Compute time / (queue wait + compute time) since start."),
    ("on_time", "dynbatchd_on_time_ratio", "Offered requests answered on time, since start."),
)
_DEVICE_GAUGES = (
    ("inflight", "dynbatchd_device_inflight_batches", "Batches sent to the worker and not yet answered."),
    ("busy_fraction", "dynbatchd_device_busy_ratio", "Fraction of time the worker spent computing."),
)
_DEVICE_COUNTERS = (
    ("restarts", "dynbatchd_device_restarts_total", "Times the worker process was restarted."),
    ("batches", "dynbatchd_device_batches_total", "Batches the worker ran."),
    ("items", "dynbatchd_device_requests_total", "Requests in the batches the worker ran."),
)
# (reading field, metric, help): per GPU, from NVML, each only where NVML answers it.
_GPU_GAUGES = (
    ("utilisation", "dynbatchd_gpu_utilisation_ratio", "GPU busy over NVML's last sample period (NVML)."),
    ("memory_used_bytes", "dynbatchd_gpu_memory_used_bytes", "GPU memory in use, every process's (NVML)."),
    ("memory_total_bytes", "dynbatchd_gpu_memory_total_bytes", "GPU memory in all (NVML)."),
    ("power_watts", "dynbatchd_gpu_power_watts", "GPU power draw (NVML)."),
)
# Metric families exported only where NVML answers (absent on a CPU-only host).
NVML_METRICS = tuple(name for _, name, _ in _GPU_GAUGES)

DAEMON_STATES = ("starting", "serving", "draining", "unavailable")
DEVICE_STATES = ("starting", "ready", "restarting", "failed")
# Batch-size histogram edges: every size up to 4, then 1.5x steps to 1024, then doublings to MAX_BATCH.
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
                      2048, 4096, 8192, 16384, 32768, 65536)


def _esc(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: Any) -> str:
    """A sample value exactly: integers in full (a counter past 1e6 keeps its last digits)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _labels(**labels: Any) -> str:
    return ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())


def _le(edge: float) -> str:
    return f"{edge:.6g}"


def _field(reading: Any, name: str) -> Any:
    return reading.get(name) if isinstance(reading, Mapping) else getattr(reading, name, None)


class _Page:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[str, Any]] = ()) -> None:
        """One metric family: HELP, TYPE, then `name{labels} value` for each (labels, value)."""
        self.lines.append(f"# HELP {name} {help_text.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.sample(name, labels, value)

    def sample(self, name: str, labels: str, value: Any) -> None:
        self.lines.append(f"{name}{{{labels}}} {_num(value)}" if labels else f"{name} {_num(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(status: dict[str, Any], latency: dict[str, Any] | None = None,
           gpu: Mapping[str, Any] | None = None) -> str:
    """Prometheus text for one status snapshot (the same data `dynbatchctl status --json` shows),
    plus each channel's lifetime latency `Histogram` as a Prometheus histogram (`latency`), so
    dashboards can take quantiles over any window with histogram_quantile(), and each GPU's
    latest NVML reading (`gpu`, by device name; by default the device observer's)."""
    if gpu is None:
        from dynbatchd.observer import gpu_readings

        gpu = gpu_readings()
    page = _Page()
    _daemon(page, status["daemon"])
    _channels(page, status["channels"], latency or {})
    _devices(page, status["devices"], gpu)
    _cache(page, status.get("cache"))
    _compliance(page, status.get("compliance"))
    _tenants(page, status.get("tenants"))
    _generation(page, status.get("generation"))
    return page.text()


def _daemon(page: _Page, daemon: dict[str, Any]) -> None:
    page.family("dynbatchd_build_info", "gauge", "The running build (value 1).",
                [(_labels(version=daemon.get("version", __version__), python=platform.python_version()), 1)])
    state = daemon.get("state", "serving")
    page.family("dynbatchd_up", "gauge",
                "1 while the daemon serves requests; 0 while starting, draining or unavailable.",
                [("", state == "serving")])
    states = DAEMON_STATES if state in DAEMON_STATES else (*DAEMON_STATES, state)
    page.family("dynbatchd_state", "gauge", "The daemon's state (1 = current).",
                [(_labels(state=s), s == state) for s in states])
    if "health" in daemon:
        page.family("dynbatchd_health_score", "gauge",
                    "0.4 on-time share + 0.3 min(1, deadline/p99) + 0.2 utilisation + 0.1 memory headroom.",
                    [("", daemon["health"]["score"])])
    page.family("dynbatchd_uptime_seconds", "gauge", "Seconds since the daemon started.", [("", daemon["uptime_s"])])
    page.family("dynbatchd_bad_requests_total", "counter", "Requests answered bad_request by the front end.",
                [("", daemon["bad_requests"])])
    for key, name, help_text in (
            ("dropped", "dynbatchd_messages_dropped_total", "Messages dropped by the front end: no reply address."),
            ("replies_undelivered", "dynbatchd_replies_undelivered_total",
             "Replies ZeroMQ could not deliver (client gone, its queue full)."),
            ("unauthenticated", "dynbatchd_unauthenticated_total",
             "Connections refused by CURVE (unknown or missing client key): never answered with data."),
    ):
        if key in daemon:
            page.family(name, "counter", help_text, [("", daemon[key])])
    if "scheduling" in daemon:
        passes = daemon["scheduling"]
        for key, name, help_text in (
                ("passes", "dynbatchd_scheduling_passes_total", "Scheduling passes that cut batches."),
                ("seconds", "dynbatchd_scheduling_seconds_total", "Wall time those passes took."),
                ("over_lead", "dynbatchd_scheduling_over_lead_total",
                 "Those that took longer than [devices] queue_lead_ms: a device may have waited for them."),
        ):
            page.family(name, "counter", help_text, [("", passes[key])])
    if "quarantined" in daemon:
        page.family("dynbatchd_quarantined_inputs", "gauge",
                    "Inputs proven to kill workers, answered model_error without running.",
                    [("", daemon["quarantined"])])


def _channels(page: _Page, channels: dict[str, dict[str, Any]], latency: dict[str, Any]) -> None:
    label = {c: _labels(channel=c) for c in channels}
    for key, name, help_text in _CHANNEL_COUNTERS:
        page.family(name, "counter", help_text, [(label[c], s[key]) for c, s in channels.items() if key in s])
    page.family("dynbatchd_requests_rejected_total", "counter", "Requests refused at admission, by reason.",
                [(_labels(channel=c, reason=r), n) for c, s in channels.items() for r, n in s["rejected"].items()])
    page.family("dynbatchd_batched_requests_total", "counter", "Requests in the live batches dispatched.",
                [(label[c], s.get("batched_items", round(s["mean_batch"] * s["batches"])))
                 for c, s in channels.items()])
    page.family("dynbatchd_batch_fill_total", "counter",
                "Sum over live batches of size / max_batch: rate() of it over rate(dynbatchd_batches_total) "
                "is the fill ratio over that window.",
                [(label[c], s.get("fill_sum", s["fill_rate"] * s["batches"])) for c, s in channels.items()])
    if any("compute_s" in s and "wait_s" in s for s in channels.values()):
        page.family("dynbatchd_batch_compute_seconds_total", "counter",
                    "Batch compute time, summed over the requests in each batch.",
                    [(label[c], s["compute_s"]) for c, s in channels.items() if "compute_s" in s])
        page.family("dynbatchd_queue_wait_seconds_total", "counter",
                    "Time dispatched requests waited in the queue before their batch was cut.",
                    [(label[c], s["wait_s"]) for c, s in channels.items() if "wait_s" in s])
    page.family("dynbatchd_warmup_batches_total", "counter", "Warmup batches run (kept out of fill and latency).",
                [(label[c], s["warmup"]["batches"]) for c, s in channels.items() if "warmup" in s])
    page.family("dynbatchd_warmup_requests_total", "counter", "Warmup inputs run.",
                [(label[c], s["warmup"]["items"]) for c, s in channels.items() if "warmup" in s])
    for key, name, help_text in _CHANNEL_GAUGES:
        page.family(name, "gauge", help_text, [(label[c], s[key]) for c, s in channels.items() if key in s])
    windows = [(c, s.get("window", {}).get("window_ms")) for c, s in channels.items()]
    page.family("dynbatchd_batch_window_seconds", "gauge", "Wait window the channel's policy last decided.",
                [(label[c], w / 1000) for c, w in windows if isinstance(w, (int, float)) and not isinstance(w, bool)])
    traffic = [(c, s.get("window", {}).get("traffic")) for c, s in channels.items()]
    page.family("dynbatchd_traffic_pattern", "gauge", "Traffic class a pattern window policy sees (1 = current).",
                [(_labels(channel=c, pattern=t), 1) for c, t in traffic if t])
    if latency:
        page.family("dynbatchd_request_duration_seconds", "histogram", "End-to-end time from acceptance to reply.")
        for c, hist in latency.items():
            for edge_us, count in hist.cumulative():
                page.sample("dynbatchd_request_duration_seconds_bucket", _labels(channel=c, le=_le(edge_us / 1e6)),
                            count)
            page.sample("dynbatchd_request_duration_seconds_bucket", _labels(channel=c, le="+Inf"), hist.total)
            page.sample("dynbatchd_request_duration_seconds_sum", _labels(channel=c), hist.sum_us / 1e6)
            page.sample("dynbatchd_request_duration_seconds_count", _labels(channel=c), hist.total)
    page.family("dynbatchd_latency_seconds", "summary",
                "End-to-end latency: quantiles over the last 30-60 s, sum and count since start.")
    for c, s in channels.items():
        for q, k in (("0.5", "p50"), ("0.99", "p99"), ("0.999", "p999")):
            page.sample("dynbatchd_latency_seconds", _labels(channel=c, quantile=q), s[f"{k}_ms"] / 1000)
        if c in latency:
            page.sample("dynbatchd_latency_seconds_sum", label[c], latency[c].sum_us / 1e6)
            page.sample("dynbatchd_latency_seconds_count", label[c], latency[c].total)
    sizes = {c: s["batch_sizes"] for c, s in channels.items() if s.get("batch_sizes") is not None}
    if sizes:
        page.family("dynbatchd_batch_size", "histogram", "Requests per live batch, counted as each batch is cut.")
        for c, counts in sizes.items():
            _batch_size_histogram(page, c, {int(k): int(v) for k, v in dict(counts).items()})


def _batch_size_histogram(page: _Page, channel: str, counts: dict[int, int]) -> None:
    total = sum(counts.values())
    for edge in BATCH_SIZE_BUCKETS:
        page.sample("dynbatchd_batch_size_bucket", _labels(channel=channel, le=edge),
                    sum(n for size, n in counts.items() if size <= edge))
    page.sample("dynbatchd_batch_size_bucket", _labels(channel=channel, le="+Inf"), total)
    page.sample("dynbatchd_batch_size_sum", _labels(channel=channel), sum(size * n for size, n in counts.items()))
    page.sample("dynbatchd_batch_size_count", _labels(channel=channel), total)


def _devices(page: _Page, devices: list[dict[str, Any]], gpu: Mapping[str, Any]) -> None:
    label = [_labels(device=d["device"], simulated=str(bool(d.get("simulated", False))).lower()) for d in devices]
    for key, name, help_text in _DEVICE_GAUGES:
        page.family(name, "gauge", help_text, [(label[i], d[key]) for i, d in enumerate(devices) if key in d])
    for key, name, help_text in _DEVICE_COUNTERS:
        page.family(name, "counter", help_text, [(label[i], d[key]) for i, d in enumerate(devices) if key in d])
    page.family("dynbatchd_device_state", "gauge", "The worker's state (1 = current).",
                [(f'{label[i]},{_labels(state=s)}', s == d["state"]) for i, d in enumerate(devices) if "state" in d
                 for s in (DEVICE_STATES if d["state"] in DEVICE_STATES else (*DEVICE_STATES, d["state"]))])
    readings = [(d["device"], d.get("gpu") or gpu.get(d["device"])) for d in devices]
    readings = [(device, r) for device, r in readings if r is not None]
    for key, name, help_text in _GPU_GAUGES:
        samples = [(_labels(device=device), _field(r, key)) for device, r in readings if _field(r, key) is not None]
        if samples:   # NVML only: no family at all where NVML does not answer
            page.family(name, "gauge", help_text, samples)


def _cache(page: _Page, cache: dict[str, Any] | None) -> None:
    if cache is None:
        return
    for key, name, help_text in (
            ("hits", "dynbatchd_cache_hits_total", "Result-cache lookups that found an entry."),
            ("misses", "dynbatchd_cache_misses_total", "Result-cache lookups that found none."),
            ("evictions", "dynbatchd_cache_evictions_total", "Entries dropped to make room (the loser of the admission comparison)."),
            ("admissions_refused", "dynbatchd_cache_admissions_refused_total",
             "Results not kept: asked less often than what they would replace, or a rare user's first ask."),
    ):
        if key in cache:
            page.family(name, "counter", help_text, [("", cache[key])])
    for key, name, help_text in (
            ("entries", "dynbatchd_cache_entries", "Entries in the result cache."),
            ("capacity", "dynbatchd_cache_capacity_entries", "Entries the result cache may hold."),
            ("bytes", "dynbatchd_cache_bytes", "Bytes the result cache holds (outputs and input texts)."),
            ("max_bytes", "dynbatchd_cache_max_bytes", "Bytes the result cache may hold (0: no byte bound)."),
            ("warmup_backlog", "dynbatchd_warmup_backlog_requests", "Warmup inputs waiting for room to run."),
    ):
        if key in cache:
            page.family(name, "gauge", help_text, [("", cache[key])])


def _compliance(page: _Page, compliance: dict[str, Any] | None) -> None:
    if compliance is None:
        return
    page.family("dynbatchd_compliance_decisions_total", "counter",
                "Requests refused by a compliance or isolation rule, or run alone by one (see the audit log).",
                [(_labels(rule=d["rule"], action=d["action"]), d["count"]) for d in compliance["decisions"]])
    page.family("dynbatchd_audit_write_errors_total", "counter", "Audit records that could not be written.",
                [("", compliance.get("write_errors", 0))])


def _tenants(page: _Page, tenants: dict[str, Any] | None) -> None:
    if tenants is None:
        return
    page.family("dynbatchd_tenant_requests_total", "counter",
                f"Requests answered, by tenant, model and code: the {tenants['top']} busiest tenants by name, "
                "the rest as (other), no tenant as (none).",
                [(_labels(tenant=t, model=m, code=c), n) for t, m, c, n in tenants["answers"]])


def _generation(page: _Page, gen: dict[str, Any] | None) -> None:
    """Generative models (dynbatchd.generating): tokens, ends, KV in use, TTFT and TPOT per channel."""
    if not gen or not (gen["running"] or gen["ended"]):   # (a daemon that has generated nothing: no families)
        return
    page.family("dynbatchd_generated_tokens_total", "counter", "Tokens generated, by channel.",
                [(_labels(channel=c), n) for c, n in gen["generated_tokens"].items()])
    page.family("dynbatchd_generations_total", "counter", "Generate requests ended, by reason.",
                [(_labels(reason=r), n) for r, n in gen["ended"].items()])
    page.family("dynbatchd_generations_running", "gauge", "Generate requests on the workers now.",
                [("", gen["running"])])
    page.family("dynbatchd_kv_in_use_tokens", "gauge", "KV cache reserved on the workers, in tokens.",
                [("", gen["kv_in_use_tokens"])])
    for key, name, what in (("ttft", "dynbatchd_time_to_first_token_seconds", "Acceptance to the first token"),
                            ("tpot", "dynbatchd_time_per_output_token_seconds", "Mean time per output token")):
        page.family(name, "histogram", f"{what}, of generations that ended well, since start.")
        for c, q in gen[key].items():
            for edge_s, count in q["buckets"]:
                page.sample(f"{name}_bucket", _labels(channel=c, le=_le(edge_s)), count)
            page.sample(f"{name}_bucket", _labels(channel=c, le="+Inf"), q["count"])
            page.sample(f"{name}_sum", _labels(channel=c), q["sum_ms"] / 1000)
            page.sample(f"{name}_count", _labels(channel=c), q["count"])
