"""The guide's full test matrix on the simulated device, summarised side by side (SIMULATED).

Runs ``dynbatchctl bench --simulated`` (in-process, its own database and pictures in a temporary
folder unless --out is given) on a config, then prints per configuration its QPS at each load,
the knee, and its peak on-time QPS as a ratio of the config's own setting for the channel.

    python -m benchmarks.bench_matrix [--config etc/dynbatchd.toml] [--duration-s 2] [--warmup-s 0.5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from typer.testing import CliRunner

from dynbatchd import config as cfgmod
from dynbatchd.cli.dynbatchctl import app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="etc/dynbatchd.toml")
    ap.add_argument("--channel", default="standard")
    ap.add_argument("--duration-s", default="2")
    ap.add_argument("--warmup-s", default="0.5")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_matrix_"))
    out.mkdir(parents=True, exist_ok=True)
    command = ["--config", args.config, "bench", "--simulated", "--channel", args.channel, "--duration-s",
               args.duration_s, "--warmup-s", args.warmup_s, "--db", str(out / "db.sqlite"), "--out", str(out),
               "--json"]
    result = CliRunner().invoke(app, command)
    if result.exit_code != 0:
        print(result.output)
        return result.exit_code
    data = json.loads(result.stdout)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    shipped = cfgmod.load(args.config).channels[args.channel]
    print(f"SIMULATED, commit {commit}: dynbatchctl {' '.join(command[:-5])}  (via python -m benchmarks.bench_matrix)")
    cells = data["cells"]
    loads = sorted({c["load"] for c in cells})
    configs = sorted({(c["max_batch"], c["window_ms"]) for c in cells})

    def peak(b, w):
        return max(c["qps"] * (c["on_time"] or 0) for c in cells if (c["max_batch"], c["window_ms"]) == (b, w))
    base = (shipped.max_batch, float(shipped.window_ms))
    base_peak = peak(*base) if base in configs else None
    print("| max_batch | window ms | " + " | ".join(f"QPS @{l:g}c" for l in loads)
          + " | knee (clients) | peak on-time QPS | vs shipped |")
    print("|" + "---|" * (len(loads) + 5))
    for b, w in configs:
        row = {c["load"]: c for c in cells if (c["max_batch"], c["window_ms"]) == (b, w)}
        knee = data["knees"][f"max_batch={b} window_ms={w:g}"]
        ratio = f"{peak(b, w) / base_peak:.2f}x" if base_peak else "-"
        mark = " (shipped)" if (b, w) == base else ""
        print(f"| {b}{mark} | {w:g} | " + " | ".join(f"{row[l]['qps']:.0f}" for l in loads)
              + f" | {knee['load']:g} | {peak(b, w):.0f} | {ratio} |" if knee else
              f"| {b}{mark} | {w:g} | " + " | ".join(f"{row[l]['qps']:.0f}" for l in loads)
              + f" | none | {peak(b, w):.0f} | {ratio} |")
    top = data["best"]
    print(f"best: max_batch={top['max_batch']} window_ms={top['window_ms']:g} at {top['load']:g} clients, "
          f"{top['qps']:.0f} QPS, {100 * top['on_time']:.1f}% on time; pictures in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
