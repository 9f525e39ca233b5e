"""Tables and the verdict against the aims, from run_all's results (also re-renders a saved JSON).

    python -m benchmarks.report                       # benchmarks/results/latest.json
    python -m benchmarks.report benchmarks/results/20250101-120000.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

AIM_SIM_FRACTION = 0.90      # of the simulated limit, at p99 <= 100 ms
AIM_DAEMON_US = 60.0         # daemon CPU per request
AIM_NOOP_RPS = 20_000.0      # no-op requests/s through one daemon


def _at(s: dict[str, Any], key: str, default: Any = None) -> Any:
    at = s.get("at_goodput")
    if not at:
        return default
    return at["cpu"].get(key, default) if key in at["cpu"] else at["result"].get(key, default)


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    by = {s["name"]: s for s in results if "failed" not in s}
    out: dict[str, Any] = {"ratios": {}, "aims": {}}
    for s in by.values():
        twin = by.get(s.get("twin_of") or "")
        if twin and s["goodput_rps"]:
            out["ratios"][f"{twin['name']} / {s['name']}"] = round(twin["goodput_rps"] / s["goodput_rps"], 2)
    sim = by.get("sim-b32")
    if sim and sim.get("limit_rps"):
        frac = sim["goodput_rps"] / sim["limit_rps"]
        out["aims"]["simulated goodput >= 90% of limit at p99 <= 100 ms (SIMULATED)"] = {
            "measured": f"{sim['goodput_rps']:.0f} req/s = {frac:.1%} of {sim['limit_rps']:.0f}",
            "met": frac >= AIM_SIM_FRACTION, "ratio_to_aim": round(frac / AIM_SIM_FRACTION, 3)}
    noop = by.get("noop-b64")
    if noop:
        out["aims"][f">= {AIM_NOOP_RPS:,.0f} no-op req/s through one daemon"] = {
            "measured": f"{noop['goodput_rps']:,.0f} req/s (p99 <= {noop['slo_ms']:g} ms, errors < 0.1 %)",
            "met": noop["goodput_rps"] >= AIM_NOOP_RPS, "ratio_to_aim": round(noop["goodput_rps"] / AIM_NOOP_RPS, 3)}
        us = _at(noop, "daemon_us_per_req")
        if us is not None:
            out["aims"][f"<= {AIM_DAEMON_US:g} us daemon CPU per request"] = {
                "measured": f"{us:g} us/req (no-op at {noop['goodput_rps']:,.0f} req/s, mean batch "
                            f"{_at(noop, 'daemon_mean_batch')})",
                "met": us <= AIM_DAEMON_US, "ratio_to_aim": round(us / AIM_DAEMON_US, 3)}
    out["exactly_once_everywhere"] = all(s.get("exactly_once") for s in results)
    return out


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v == float("inf"):
        return "inf"
    return format(v, spec) if spec else str(v)


def render(doc: dict[str, Any]) -> str:
    lines = [f"Command: `{doc['command']}`  ({doc['duration_s']:g} s per run, {doc['wall_s']:g} s in all)",
             f"Machine: {doc['environment']['cores']} cores, {doc['environment']['cpu']}; generator, daemon and "
             "workers share them.", "",
             "| scenario | SLO p99 | goodput req/s | % of limit | p50 ms | p99 ms | p99.9 ms | errors | "
             "batch (req-weighted / per batch) | daemon µs/req | workers µs/req | other load (cores) | exactly once |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in doc["scenarios"]:
        if "failed" in s:
            lines.append(f"| {s['name']} | FAILED: {s['failed'].splitlines()[0]} |")
            continue
        label = ("SIMULATED " if s["simulated"] else "") + s["name"]
        limit = f"{s['goodput_rps'] / s['limit_rps']:.1%}" if s.get("limit_rps") else "-"
        lines.append(
            f"| {label} | {s['slo_ms']:g} ms | {s['goodput_rps']:,.0f} | {limit} | {_fmt(_at(s, 'p50_ms'), '.2f')} | "
            f"{_fmt(_at(s, 'p99_ms'), '.2f')} | {_fmt(_at(s, 'p999_ms'), '.2f')} | "
            f"{_errors(s)} | {_fmt(_at(s, 'mean_batch'), '.1f')} / {_fmt(_at(s, 'daemon_mean_batch'), '.1f')} | "
            f"{_fmt(_at(s, 'daemon_us_per_req'))} | {_fmt(_at(s, 'workers_us_per_req'))} | "
            f"{_fmt(_at(s, 'other_cores'))} | {'yes' if s['exactly_once'] else 'NO'} |")
    fixed = [(s, f) for s in doc["scenarios"] if "failed" not in s for f in s.get("fixed", [])]
    if fixed:
        lines += ["", "Fixed-rate runs (CPU per request without the search):", "",
                  "| scenario | offered req/s | achieved | p50 ms | p99 ms | batch | daemon µs/req | workers µs/req | "
                  "daemon cores |", "|---|---|---|---|---|---|---|---|---|"]
        for s, f in fixed:
            r, c = f["result"], f["cpu"]
            lines.append(f"| {s['name']} | {f['rate']:,.0f} | {r['achieved_rps']:,.0f} | {r['p50_ms']:.2f} | "
                         f"{r['p99_ms']:.2f} | {r['mean_batch']:.1f} | {_fmt(c['daemon_us_per_req'])} | "
                         f"{_fmt(c['workers_us_per_req'])} | {_fmt(c['daemon_cores'])} |")
    lines += ["", "Every trial of the goodput searches:", "",
              "| scenario | offered req/s | achieved ok/s | p50 ms | p99 ms | errors | mean batch | daemon µs/req | "
              "daemon RSS growth KB/1k req | other load (cores) | pass |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in doc["scenarios"]:
        for t in s.get("trials", []):
            r, c = t["result"], t["cpu"]
            lines.append(f"| {s['name']} | {t['rate']:,.1f} | {r['achieved_rps']:,.1f} | {_fmt(r['p50_ms'], '.2f')} | "
                         f"{_fmt(r['p99_ms'], '.2f')} | {sum(r['errors'].values())} | {r['mean_batch']:.1f} | "
                         f"{_fmt(c['daemon_us_per_req'])} | {_fmt(c.get('daemon_rss_growth_kb_per_1k_req'))} | "
                         f"{_fmt(c.get('other_cores'))} | "
                         f"{'PASS' if t['pass'] else 'fail'} |")
    summ = doc.get("summary", {})
    if summ.get("ratios"):
        lines += ["", "Batching gain (goodput ratio, same run): " +
                  "; ".join(f"{k} = {v:g}x" for k, v in summ["ratios"].items())]
    if summ.get("aims"):
        lines += ["", "| aim | measured | met | measured / aim |", "|---|---|---|---|"]
        for aim, v in summ["aims"].items():
            lines.append(f"| {aim} | {v['measured']} | {'yes' if v['met'] else 'NO'} | {v['ratio_to_aim']:g} |")
    trouble = [(s["name"], t) for s in doc["scenarios"] for t in s.get("daemon_trouble", [])]
    if trouble:
        lines += ["", "Daemon log trouble:"] + [f"  {n}: {t}" for n, t in trouble]
    return "\n".join(lines)


def _errors(s: dict[str, Any]) -> str:
    r = s["at_goodput"]["result"] if s.get("at_goodput") else None
    if not r:
        return "-"
    return str(sum(r["errors"].values())) + (f" {r['errors']}" if r["errors"] else "") + f" of {r['sent']}"


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if args and args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    path = Path(args[0]) if args else Path(__file__).resolve().parent / "results" / "latest.json"
    doc = json.loads(path.read_text())
    print(render(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
