"""The shipped channels through the live daemon, beside the simulator (`benchmarks.bursty
--live-shipped`): etc/dynbatchd.toml's channels and routing, its model swapped for the "simulated"
runner on bursty's device, every tenth request urgent (routed to realtime), the same arrivals sent
open loop over real sockets, and the replies awaited for the longest deadline of a channel used
(bulk's 30 s) past the last send. Printed per channel: on-time share live and simulated (SIMULATED
device either way); realtime's bar is 99.9%."""

from __future__ import annotations

import os
import tempfile

import numpy as np

from dynbatchd import config
from dynbatchd.plugins import Plugins
from dynbatchd.simulate import DeviceModel

from benchmarks.bursty import SHIPPED, shipped_arrivals, simulate_shipped
from benchmarks.harness import ipc_daemon, toml_value

CHANNEL_KEYS = ("max_batch", "window_ms", "deadline_ms", "queue_limit", "priority", "min_share")
URGENT = 0.1


def shipped_body(device: DeviceModel):
    """The config text for `ipc_daemon`: the shipped channels and routing on one simulated model."""
    shipped = config.load(str(SHIPPED))
    routing = config.table_of(shipped, "routing")

    def body(endpoint: str, control: str) -> str:
        lines = [f'[daemon]\nlisten = "{endpoint}"\ncontrol = "{control}"\nlog_level = "warning"',
                 f'[devices]\nuse = ["cpu"]\ninflight = {shipped.devices.inflight}\n'
                 f'queue_lead_ms = {shipped.devices.queue_lead_ms!r}',
                 f'[models.sim]\nrunner = "simulated"\noptions = {toml_value(device.options())}']
        for name, channel in shipped.channels.items():
            values = "\n".join(f"{k} = {toml_value(getattr(channel, k))}" for k in CHANNEL_KEYS)
            lines.append(f"[channels.{name}]\n{values}")
        lines.append(f"[routing]\ndefault = {toml_value(routing['default'])}")
        for rule in routing.get("rules", []):
            lines.append("[[routing.rules]]\n" + "\n".join(f"{k} = {toml_value(v)}" for k, v in rule.items()))
        return "\n\n".join(lines) + "\n"
    return body


def compare_live_shipped(rows: list[tuple[float, int]], speedups: list[float], plugins: Plugins,
                         device: DeviceModel) -> None:
    from benchmarks.loadgen import send_open_loop
    from dynbatchd.client import build_request

    shipped = config.load(str(SHIPPED))
    deadline = {name: c.deadline_ms for name, c in shipped.channels.items()}
    print(f"\nThe shipped channels through the live daemon (runner \"simulated\", real sockets) vs simulation, "
          f"{URGENT:.0%} urgent")
    print("| speed-up | channel | requests | on time live | on time sim | send lag p99 ms | load avg |")
    print("|---|---|---|---|---|---|---|")
    for speedup in speedups:
        arrivals = shipped_arrivals(rows, speedup, URGENT)
        sim = simulate_shipped(shipped, shipped.channels, arrivals, plugins, device,
                               routing=config.table_of(shipped, "routing"))
        channel_of = sim.channel_of
        drain_s = 5.0 + max(deadline[name] for name in set(channel_of)) / 1000   # bulk may answer 30 s late
        offsets = np.array([a.at_ns / 1e9 for a in arrivals])
        headers = [build_request(i + 1, "sim", 0, tags=a.tags, tokens=a.tokens)[0] for i, a in enumerate(arrivals)]
        with tempfile.TemporaryDirectory(prefix="dynbatchd-shipped-") as tmp:
            with ipc_daemon(tmp, shipped_body(device), name="dynbatchd (shipped, live)").start(60.0):
                load = os.getloadavg()[0]
                sent = send_open_loop(f"ipc://{tmp}/req.sock", offsets, headers, drain_s=drain_s, start_delay_s=0.05)
        latency = sent.latency_ms()
        lag = float(np.percentile(sent.sent_lag, 99) * 1000.0)
        for name in shipped.channels:
            mine = [i for i, c in enumerate(channel_of) if c == name]
            if not mine:
                continue
            live = sum(sent.code(i) == "ok" and latency[i] <= deadline[name] for i in mine) / len(mine)
            simulated = sum(sim.on_time(i) for i in mine) / len(mine)
            print(f"| x{speedup:g} | {name} | {len(mine)} | {live:.2%} | {simulated:.2%} | {lag:.1f} | {load:.1f} |",
                  flush=True)
