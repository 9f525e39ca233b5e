"""The sales-peak scenario's mechanics, scaled down: the cache runs inside the simulated engine, and
frequency admission keeps the daily users' results where an LRU loses them (SIMULATED)."""

from __future__ import annotations

from benchmarks import peak


def test_frequency_admission_keeps_the_hot_set_where_lru_loses_it():
    rows = {r["setup"]: r for r in peak.sales_peak(seconds=12.0)}
    lru, tinylfu, lifecycle = (rows[name] for name in ("untagged LRU (before)", "frequency admission, untagged",
                                                       "lifecycle tags + frequency admission"))
    assert lru["admissions_refused"] == 0 and tinylfu["admissions_refused"] > 0
    assert tinylfu["hit_rate"] > lru["hit_rate"] + 0.1
    assert lifecycle["hit_rate"] >= tinylfu["hit_rate"]
    assert lifecycle["refresh_p99_ms"] < lru["refresh_p99_ms"]


def test_the_k12_surge_keeps_realtime_on_time_on_the_shipped_config():
    rows = peak.k12(hour_s=10.0)
    surge = rows[1]
    assert surge["offered_rps"] > 3 * rows[0]["offered_rps"]
    assert surge["channels"]["realtime"]["on_time"] >= 0.999
    assert surge["channels"]["bulk"]["completed"] == surge["channels"]["bulk"]["offered"]
