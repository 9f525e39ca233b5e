"""A live daemon's /metrics page: promtool accepts it, a real Prometheus scrapes it and answers
queries over it, and every metric the Grafana dashboard (grafana/dynbatchd.json) queries is on it.

promtool and prometheus come from Debian's `prometheus` package (.ci/run installs it); the
tests that need them skip, saying so, where they are missing.

Metrics the dashboard may query although this page lacks them, each for a stated reason:

- NVML_ONLY (`dynbatchd.metrics.NVML_METRICS`): GPU utilisation, memory and power exist only
  where NVML answers for a device; this daemon runs on the CPU.
- WAITING_FOR_STATUS: families the metrics side renders as soon as `status` carries the field
  named here (docs/metrics.md, "Waiting for status fields"); allowed absent only while the
  live status still lacks that field, so the allowance ends by itself when the field lands.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import SIMULATED, free_port, start_daemon
from dynbatchd import metrics
from dynbatchd.client import Client

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "grafana" / "dynbatchd.json"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
MISSING = "not installed (Debian package `prometheus`; .ci/run installs it)"

NVML_ONLY = set(metrics.NVML_METRICS)
# metric -> (status section, the field whose arrival makes the daemon export it)
WAITING_FOR_STATUS = {
    "dynbatchd_batch_size_bucket": ("channels", "batch_sizes"),
    "dynbatchd_batch_compute_seconds_total": ("channels", "compute_s"),
    "dynbatchd_queue_wait_seconds_total": ("channels", "wait_s"),
    "dynbatchd_cache_evictions_total": ("cache", "evictions"),
}

REQUESTS = 12


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """The shared simulated config plus a result cache, so the cache families are on the page too."""
    port = free_port()
    running = start_daemon(tmp_path_factory.mktemp("metrics"), SIMULATED + "\n[cache]\nentries = 64\n",
                           daemon_extra=f'metrics_listen = "127.0.0.1:{port}"')
    running.metrics_port = port
    running.metrics_url = f"http://127.0.0.1:{port}/metrics"
    try:
        with Client(running.endpoint) as client:
            for i in range(REQUESTS):
                client.infer("sim", f"text {i % 4}")   # 4 computed, the rest from the cache
                client.infer("sim", "now", tags=["urgent"])
        yield running
    finally:
        running.stop()


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def series_names(page: str) -> set[str]:
    return {re.match(r"[a-zA-Z_:][\w:]*", line).group(0) for line in page.splitlines()
            if line and not line.startswith("#")}


# -- PromQL: the metric names an expression selects ---------------------------

_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
             "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names selected in a PromQL expression: identifiers that are neither functions nor
    keywords, outside strings, label matchers, ranges and grouping clauses."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = _GROUPING.sub(" ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w$.:])[a-zA-Z_:][\w:]*", expr):
        rest = expr[match.end():].lstrip()
        if match.group(0).lower() not in _KEYWORDS and not rest.startswith("("):
            names.add(match.group(0))
    return names


def test_metric_names_parser():
    assert metric_names('histogram_quantile(0.99, sum by (channel, le) (rate(a_bucket{x=~"$c",y="or"}[$__rate_interval])))'
                        ) == {"a_bucket"}
    assert metric_names("(sum by (c) (rate(a_total[5m])) / (sum(b) + c)) or max by (c) (d{e=\"f\"})") == {
        "a_total", "b", "c", "d"}
    assert metric_names("x offset 5m > bool 1e3 unless on (a) group_left (b) y") == {"x", "y"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> list[dict]:
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))   # collapsed rows hold theirs
    return [p for p in out if p.get("type") != "row"]


def dashboard_queries(board: dict) -> list[str]:
    """Every PromQL expression: the panels' targets, and the selectors inside label_values()."""
    exprs = [t["expr"] for p in panels(board) for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append(re.fullmatch(r"label_values\((.*),\s*\w+\)", query).group(1))
    return exprs


def as_promql(expr: str) -> str:
    """A dashboard expression with Grafana's variables replaced, as Prometheus would get it."""
    return expr.replace("$__rate_interval", "1m").replace("$instance", ".*").replace(
        "$channel", ".*").replace("$device", ".*")


# -- the tests ------------------------------------------------------------------

@pytest.mark.skipif(PROMTOOL is None, reason=f"promtool {MISSING}")
def test_promtool_accepts_the_live_page(daemon):
    page = scrape(daemon.metrics_url)
    assert "dynbatchd_cache_hits_total" in page and "dynbatchd_request_duration_seconds_bucket" in page
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=page, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, f"promtool check metrics:\n{check.stdout}{check.stderr}"


def test_the_dashboard_is_importable():
    board = dashboard()
    assert board["schemaVersion"] >= 36 and board["title"] and board["uid"]
    [source] = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert source["name"] == "DS_PROMETHEUS" and source["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert panel["targets"] and all(t["datasource"] == panel["datasource"] for t in panel["targets"])
    titles = {p["title"] for p in panels(board)}
    for wanted in ("Queue depth", "Request rate", "Latency p50 / p99", "On-time share", "Batch fill rate",
                   "Scheduling efficiency", "Rejections and misses by reason", "Utilisation", "GPU memory",
                   "GPU power", "Worker restarts", "Health score"):
        assert wanted in titles
    quantiles = [e for e in dashboard_queries(board) if "histogram_quantile" in e]
    assert any("rate(dynbatchd_request_duration_seconds_bucket" in e for e in quantiles)


def test_every_metric_the_dashboard_queries_is_on_the_live_page(daemon):
    page_names = series_names(scrape(daemon.metrics_url))
    status = daemon.status()
    missing = {}
    for expr in dashboard_queries(dashboard()):
        for name in metric_names(expr) - page_names:
            missing.setdefault(name, expr)
    allowed = set(NVML_ONLY)
    for name, (section, field) in WAITING_FOR_STATUS.items():
        part = status[section]
        records = part.values() if section == "channels" else [part]
        if not all(field in record for record in records):
            allowed.add(name)
    unexplained = {name: expr for name, expr in missing.items() if name not in allowed}
    assert not unexplained, f"the dashboard queries metrics the daemon does not export: {unexplained}"


def prometheus_query(base: str, expr: str) -> dict:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        return json.loads(urllib.request.urlopen(url, timeout=10).read())
    except urllib.error.HTTPError as exc:   # a bad query: 400 with Prometheus's error as JSON
        return json.loads(exc.read())


@pytest.mark.skipif(PROMETHEUS is None, reason=f"prometheus {MISSING}")
def test_a_real_prometheus_scrapes_the_daemon(daemon, tmp_path):
    web = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: dynbatchd
    scrape_interval: 1s
    scrape_timeout: 1s
    static_configs:
      - targets: ["127.0.0.1:{daemon.metrics_port}"]
""")
    log = tmp_path / "prometheus.log"
    with log.open("w") as out:
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{web}"], stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{web}"
    try:
        deadline = time.monotonic() + 90
        completed = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"prometheus exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                answer = prometheus_query(base, 'dynbatchd_requests_completed_total{job="dynbatchd",channel="standard"}')
            except (OSError, ValueError):
                answer = None   # not listening yet
            if answer and answer["status"] == "success" and answer["data"]["result"]:
                completed = float(answer["data"]["result"][0]["value"][1])
                break
            time.sleep(0.2)
        assert completed is not None, f"no scrape within 90 s:\n{log.read_text()[-3000:]}"
        assert completed >= 4   # 4 distinct inputs ran; the rest came from the cache
        up = prometheus_query(base, 'up{job="dynbatchd"}')["data"]["result"]
        assert [float(r["value"][1]) for r in up] == [1.0]
        info = prometheus_query(base, "dynbatchd_build_info")["data"]["result"]
        assert info and info[0]["metric"]["version"] == daemon.status()["daemon"]["version"]
        # every dashboard expression is valid PromQL that Prometheus evaluates over this data
        for expr in dashboard_queries(dashboard()):
            answer = prometheus_query(base, as_promql(expr))
            assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
