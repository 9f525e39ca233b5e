"""A malformed trace, row by row: each is refused by `read_trace_csv` with a ValueError naming the
file, the line and what is wrong, and by `simulate --trace` as that one line, exit 2; a spreadsheet's
byte-order mark before the header is not part of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynbatchd.cli.dynbatchctl import app
from dynbatchd.simulate import read_trace_csv

SHIPPED = str(Path(__file__).resolve().parents[2] / "etc" / "dynbatchd.toml")
MOONCAKE_OK = '{"timestamp": 0, "input_length": 10}\n'
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens\n"

BAD = [   # (name, content, line of the fault, what the message says)
    ("timestamp-text.jsonl", MOONCAKE_OK + '{"timestamp": "x", "input_length": 5}\n', 2, "timestamp"),
    ("not-an-object.jsonl", MOONCAKE_OK + "[1, 2]\n", 2, "not a JSON object"),
    ("not-json.jsonl", MOONCAKE_OK + "{oops\n", 2, "not JSON"),
    ("huge-timestamp.jsonl", MOONCAKE_OK + '{"timestamp": 1e308, "input_length": 5}\n', 2, "time"),
    ("long-int-timestamp.jsonl", MOONCAKE_OK + '{"timestamp": 1' + "0" * 400 + ', "input_length": 5}\n', 2,
     "time"),
    ("negative.jsonl", MOONCAKE_OK + '{"timestamp": -5, "input_length": 5}\n', 2, "time"),
    ("no-length.jsonl", MOONCAKE_OK + '{"timestamp": 5}\n', 2, "input_length"),
    ("fraction.jsonl", MOONCAKE_OK + '{"timestamp": 5, "input_length": 2.5}\n', 2, "token count"),
    ("huge-time.csv", BURST_HEADER + "1,a,10,1\n1e300,a,10,1\n", 3, "time"),
    ("nan-time.csv", BURST_HEADER + "nan,a,10,1\n", 2, "Timestamp"),
    ("inf-tokens.csv", BURST_HEADER + "1,a,1e400,1\n", 2, "token count"),
    ("nan-tokens.csv", BURST_HEADER + "1,a,nan,1\n", 2, "token count"),
    ("short-row.csv", BURST_HEADER + "1,a\n", 2, "Request tokens"),
    ("bad-date.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.5,3\nyesterday,3\n", 3, "TIMESTAMP"),
]


@pytest.mark.parametrize("name, content, line, what", BAD, ids=[b[0] for b in BAD])
def test_a_bad_row_is_refused_naming_file_line_and_fault(tmp_path, name, content, line, what):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        read_trace_csv(path)
    assert str(info.value).startswith(f"{path}, line {line}: ") and what in str(info.value)
    result = CliRunner().invoke(app, ["simulate", "--config", SHIPPED, "--trace", str(path)])
    lines = [text for text in result.output.splitlines() if text.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error:") and f"line {line}" in lines[0]


def test_a_byte_order_mark_before_the_header_is_read_as_utf8_sig(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbfTIMESTAMP,ContextTokens\n2023-11-16 18:15:46.5,374\n2023-11-16 18:15:47.5,9\n")
    assert read_trace_csv(path) == [(0.0, 374), (1.0, 9)]


def test_text_that_is_not_utf8_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes(b"Timestamp,Model,Request tokens\n1,caf\xe9,3\n")
    with pytest.raises(ValueError, match=f"^{path}: not UTF-8"):
        read_trace_csv(path)


def test_whole_numbers_written_as_floats_or_padded_are_taken(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text(BURST_HEADER + "2,a,5.0,1\n1,a, 7 ,1\n")
    assert read_trace_csv(path) == [(0.0, 7), (1.0, 5)]
