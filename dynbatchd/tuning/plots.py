"""Bench pictures: the guide's 3-D scatter (PNG and self-contained HTML) and QPS-vs-load curves
with the knee marked. Headless (matplotlib's Agg backend); the HTML embeds plotly.js, so it opens
offline. Every title says SIMULATED when the figures are."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from dynbatchd.tuning.knee import Knee, find_knee


def _label(rows: Sequence[dict[str, Any]], commit: str) -> str:
    simulated = any(r.get("simulated") for r in rows)
    return ("SIMULATED " if simulated else "") + f"dynbatchctl bench, commit {commit}"


def curves(rows: Sequence[dict[str, Any]]) -> dict[tuple[int, float], dict[str, Any]]:
    """Per (max_batch, window_ms): loads, QPS and its knee (or None), loads ascending."""
    grouped: dict[tuple[int, float], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        grouped[(int(r["max_batch"]), float(r["window_ms"]))].append(r)
    out = {}
    for key, group in sorted(grouped.items()):
        group.sort(key=lambda r: r["load"])
        loads, qps = [r["load"] for r in group], [r["qps"] for r in group]
        out[key] = {"loads": loads, "qps": qps, "knee": find_knee(loads, qps)}
    return out


def scatter_png(rows: Sequence[dict[str, Any]], path: Path, commit: str, z: str = "qps") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(8, 6))
    ax = fig.add_subplot(projection="3d")
    util = [r.get("device_utilisation") or 0.0 for r in rows]
    points = ax.scatter([r["max_batch"] for r in rows], [r["window_ms"] for r in rows],
                        [r.get(z) or 0.0 for r in rows], c=util, cmap="viridis", vmin=0.0, vmax=1.0, s=40)
    ax.set_xlabel("max_batch")
    ax.set_ylabel("window (ms)")
    ax.set_zlabel("QPS" if z == "qps" else f"{z}", labelpad=6)
    fig.colorbar(points, ax=ax, shrink=0.6, pad=0.12, label="device utilisation")
    ax.set_title(_label(rows, commit), fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def scatter_html(rows: Sequence[dict[str, Any]], path: Path, commit: str) -> Path:
    """Interactive: QPS and p99 as two traces (toggle in the legend); plotly.js embedded (offline)."""
    import plotly.graph_objects as go

    hover = [f"load {r['load']:g} ({r['load_kind']})<br>QPS {r['qps']:.1f}<br>p99 {r.get('p99_ms') or 0:.1f} ms"
             f"<br>on time {100 * (r.get('on_time') or 0):.1f}%" for r in rows]
    fig = go.Figure()
    for z, name, visible in (("qps", "QPS", True), ("p99_ms", "p99 (ms)", "legendonly")):
        fig.add_trace(go.Scatter3d(x=[r["max_batch"] for r in rows], y=[r["window_ms"] for r in rows],
                                   z=[r.get(z) or 0.0 for r in rows], mode="markers", name=name, visible=visible,
                                   text=hover, hoverinfo="text",
                                   marker=dict(size=5, color=[r.get("device_utilisation") or 0.0 for r in rows],
                                               colorscale="Viridis", cmin=0, cmax=1,
                                               colorbar=dict(title="device util"))))
    fig.update_layout(title=_label(rows, commit),
                      scene=dict(xaxis_title="max_batch", yaxis_title="window (ms)", zaxis_title="QPS / p99 ms"))
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)
    return path


def knee_png(rows: Sequence[dict[str, Any]], path: Path, commit: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for (batch, window), c in curves(rows).items():
        line, = ax.plot(c["loads"], c["qps"], marker="o", label=f"max_batch {batch}, window {window:g} ms")
        knee: Knee | None = c["knee"]
        if knee is not None:
            ax.scatter([knee.load], [knee.qps], s=160, facecolors="none", edgecolors=line.get_color(), linewidths=2)
    kind = rows[0]["load_kind"] if rows else "closed"
    ax.set_xlabel("concurrency (clients)" if kind == "closed" else "offered rate (req/s)")
    ax.set_ylabel("QPS")
    ax.set_title(_label(rows, commit) + " — circles: knee", fontsize=9)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_all(rows: Sequence[dict[str, Any]], out_dir: Path, commit: str) -> dict[str, str]:
    """The three pictures in `out_dir` (created); their paths by kind."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {"scatter_png": str(scatter_png(rows, out_dir / "scatter.png", commit)),
            "scatter_html": str(scatter_html(rows, out_dir / "scatter.html", commit)),
            "knee_png": str(knee_png(rows, out_dir / "qps_vs_load.png", commit))}
