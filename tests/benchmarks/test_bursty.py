"""`benchmarks.bursty` on a trace of its own (`--trace`), with what `long_share` trades
(`--long-shares`): a tiny replay, SIMULATED, checked for what it prints."""

from __future__ import annotations

import random
from datetime import datetime, timedelta

from benchmarks import bursty
from dynbatchd.simulate import Arrival


def test_the_longest_tenth_is_the_top_tenth_by_tokens_ties_included():
    arrivals = [Arrival(i, tokens) for i, tokens in enumerate([5, 1, 9, 3, 9, 2, 7, 4, 6, 8] * 2)]
    longest = bursty.longest_tenth(arrivals)
    assert sorted(arrivals[i].tokens for i in longest) == [9, 9, 9, 9]   # the cut is 9; all four nines


def write_trace(path, rows: int = 400, seed: int = 3) -> None:
    """Bursts of mixed sizes: `rows` requests in 40 bursts over ~20 minutes (times compressed x40
    by the replay), the Azure trace's columns."""
    rng = random.Random(seed)
    t0 = datetime(2023, 11, 16, 18, 0, 0)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(rows):
        at = t0 + timedelta(seconds=30 * (i // 10) + rng.random())
        lines.append(f"{at:%Y-%m-%d %H:%M:%S.%f}0,{rng.choice([200, 900, 1500, 7000])},10")
    path.write_text("\n".join(lines) + "\n")


def test_it_replays_another_trace_and_prints_the_long_share_trade(tmp_path, capsys):
    trace = tmp_path / "code.csv"
    write_trace(trace)
    assert bursty.main(["--trace", str(trace), "--speedups", "40", "--long-shares", "0,0.9"]) == 0
    out = capsys.readouterr().out
    assert "trace code.csv" in out and "SIMULATED" in out
    assert "| x40 | deadline-order plan, drop the largest |" in out
    table = [line.split("|") for line in out.split("\n\n")[1].splitlines() if line.startswith("| x40 |")]
    on_time = {cells[2].strip(): float(cells[3].strip(" %")) for cells in table}
    bound = on_time.pop("upper bound: no schedule does more")
    assert len(on_time) == 6 and all(share <= bound for share in on_time.values())   # (both to 2 decimals)
    assert "| x40 | (upper bound at 0.9 of FIFO-drop's) |" in out
    trade = [line for line in out.splitlines() if line.startswith("| x40 | 0") or "(the planner)" in line]
    assert [line.split("|")[2].strip() for line in trade] == ["(the planner)", "0", "0.9"]
    for line in trade[1:]:   # on time, requests less the planner's, longest tenth of FIFO-drop's
        cells = [c.strip() for c in line.split("|")[3:6]]
        assert cells[0].endswith("%") and int(cells[1]) <= 400 and float(cells[2]) >= 0


def test_a_missing_trace_is_said_in_one_line(tmp_path, capsys):
    assert bursty.main(["--trace", str(tmp_path / "absent.csv")]) == 2
    assert "absent.csv is missing" in capsys.readouterr().err


def test_the_live_shipped_config_is_the_shipped_channels_and_routing_on_the_simulated_device(tmp_path):
    from benchmarks.shippedlive import CHANNEL_KEYS, SHIPPED, shipped_body
    from dynbatchd import config

    path = tmp_path / "dynbatchd.toml"
    path.write_text(shipped_body(bursty.DEVICE)("ipc:///tmp/x/req.sock", "ipc:///tmp/x/ctl.sock"))
    live, shipped = config.load(str(path)), config.load(str(SHIPPED))
    assert list(live.channels) == list(shipped.channels)
    for name, channel in shipped.channels.items():
        assert {k: getattr(live.channels[name], k) for k in CHANNEL_KEYS} == \
            {k: getattr(channel, k) for k in CHANNEL_KEYS}
    assert config.table_of(live, "routing") == config.table_of(shipped, "routing")
    assert live.models["sim"].runner == "simulated" and list(live.models) == ["sim"]


def test_it_replays_the_shipped_channels_through_the_live_daemon(tmp_path, capsys):
    trace = tmp_path / "code.csv"
    write_trace(trace, rows=60)   # 6 bursts over 3 minutes: 4.5 s at x40
    assert bursty.main(["--trace", str(trace), "--speedups", "40", "--live-shipped", "40"]) == 0
    out = capsys.readouterr().out.split("The shipped channels through the live daemon")[1]
    rows = {line.split("|")[2].strip(): line.split("|") for line in out.splitlines() if line.startswith("| x40 |")}
    assert set(rows) <= {"realtime", "standard", "bulk"} and "standard" in rows
    assert sum(int(cells[3]) for cells in rows.values()) == 60
    assert all(cells[4].strip().endswith("%") and cells[5].strip().endswith("%") for cells in rows.values())
