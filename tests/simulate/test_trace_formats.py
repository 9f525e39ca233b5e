"""`read_trace_csv`: the three public trace formats give the same arrivals, and anything else
is refused with a message naming what it reads."""

from __future__ import annotations

import json

import pytest

from dynbatchd.simulate import read_trace_csv

# (seconds after the first request, tokens), out of time order on purpose
REQUESTS = [(0.0, 6758), (2.5, 120), (0.75, 23141), (3.0, 915)]


def write_all(tmp_path) -> dict[str, object]:
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{46 + int(t):02d}.{int(round(t % 1 * 1e7)):07d},{n},10\n" for t, n in REQUESTS))
    burst = tmp_path / "burstgpt.csv"
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "".join(
        f"{100 + t},ChatGPT,{n},10,{n + 10},Conversation log\n" for t, n in REQUESTS))
    mooncake = tmp_path / "mooncake.jsonl"
    mooncake.write_text("".join(json.dumps({"timestamp": int(5000 + t * 1000), "input_length": n,
                                            "output_length": 10, "hash_ids": [0]}) + "\n" for t, n in REQUESTS) + "\n")
    return {"azure": azure, "burstgpt": burst, "mooncake": mooncake}


def test_each_format_reads_to_the_same_requests_in_time_order(tmp_path):
    expected = sorted(REQUESTS)
    for name, path in write_all(tmp_path).items():
        rows = read_trace_csv(path)
        assert [n for _, n in rows] == [n for _, n in expected], name
        assert [t for t, _ in rows] == pytest.approx([t for t, _ in expected], abs=1e-6), name


def test_another_file_is_refused_naming_the_formats_it_reads(tmp_path):
    other = tmp_path / "other.csv"
    other.write_text("time,size\n1,2\n")
    with pytest.raises(ValueError, match="TIMESTAMP and ContextTokens.*input_length"):
        read_trace_csv(other)
