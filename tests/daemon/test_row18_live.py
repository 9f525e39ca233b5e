"""Row 18 of the guide, live: a request's type and its user's frequency steer routing and the
result cache, over ZeroMQ (the request's `request_type` / `user_frequency` fields) and over HTTP
(the `X-Request-Type` / `X-User-Frequency` headers). One daemon in a subprocess, real sockets.

Each test fails when the routing rules or the `lifecycle` cache policy ignore either field:
- routing: a rule on `request_type` sends refreshes to `refresh`, one on `user_frequency` sends
  daily users to `frequent`; everything else goes to `standard`;
- the cache (3 entries, so it is full and must choose): a `rare` user's answer is kept only once
  asked before (their repeat is recomputed, their third ask is a hit), a `daily` user's repeat is a
  hit; a `session_refresh` answer is kept even when the cache is full of answers asked more often,
  a new session's (asked once) is not.
"""

from __future__ import annotations

import itertools
import json
import urllib.request

import pytest

from conftest import free_port, start_daemon
from dynbatchd.client import Client

BODY = """
    [models.enc]
    runner = "callable"
    options = { target = "helpers:embed" }
    [channels.standard]
    max_batch = 8
    window_ms = 1
    [channels.refresh]
    max_batch = 8
    window_ms = 1
    [channels.frequent]
    max_batch = 8
    window_ms = 1
    [routing]
    default = "standard"
    [[routing.rules]]
    request_type = "session_refresh"
    channel = "refresh"
    [[routing.rules]]
    user_frequency = "daily"
    channel = "frequent"
    [cache]
    entries = 3
    policy = "lifecycle"
    refresh_types = ["session_refresh"]
    rare_users = ["rare"]
"""

_texts = itertools.count()


def fresh(what: str) -> str:
    """A text never asked before in this daemon."""
    return f"{what} {next(_texts)}"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    port = free_port()
    running = start_daemon(tmp_path_factory.mktemp("row18"), BODY + f'\n[http]\nlisten = "127.0.0.1:{port}"\n')
    running.http = f"http://127.0.0.1:{port}"
    yield running
    running.stop()


class Zmq:
    """Asks over ZeroMQ; what it reports: (channel, answered from the cache)."""

    def __init__(self, daemon):
        self.client = Client(daemon.endpoint, timeout=30)

    def ask(self, text: str, request_type: str | None = None, user_frequency: str | None = None) -> tuple[str, bool]:
        result = self.client.infer_result("enc", text, request_type=request_type, user_frequency=user_frequency)
        assert result.output.tolist() == [len(text), len(text.split()), 1.0]
        return result.timing.channel, result.timing.device == "cache"

    def close(self) -> None:
        self.client.close()


class Http:
    """Asks over HTTP (OpenAI embeddings) with the headers; the reply has no timing, so what it
    reports comes from the daemon's status: the channel whose count went up, and whether it was a hit."""

    def __init__(self, daemon):
        self.daemon = daemon

    def counts(self) -> dict[str, tuple[int, int]]:
        return {name: (ch["completed"], ch["cache_hits"]) for name, ch in self.daemon.status()["channels"].items()}

    def ask(self, text: str, request_type: str | None = None, user_frequency: str | None = None) -> tuple[str, bool]:
        headers = {"Content-Type": "application/json"}
        if request_type:
            headers["X-Request-Type"] = request_type
        if user_frequency:
            headers["X-User-Frequency"] = user_frequency
        before = self.counts()
        request = urllib.request.Request(self.daemon.http + "/v1/embeddings", headers=headers,
                                         data=json.dumps({"model": "enc", "input": text}).encode())
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert reply.status == 200
            assert json.loads(reply.read())["data"][0]["embedding"] == [len(text), len(text.split()), 1.0]
        after = self.counts()
        [(channel, hit)] = [(name, after[name][1] > before[name][1]) for name in after if after[name] != before[name]]
        return channel, hit

    def close(self) -> None:
        pass


@pytest.fixture(params=["zmq", "http"])
def door(request, daemon):
    asker = Zmq(daemon) if request.param == "zmq" else Http(daemon)
    yield asker
    asker.close()


def test_request_type_and_user_frequency_pick_the_channel(door):
    assert door.ask(fresh("refresh"), request_type="session_refresh")[0] == "refresh"
    assert door.ask(fresh("refresh, daily"), "session_refresh", "daily")[0] == "refresh"   # the first rule wins
    assert door.ask(fresh("daily"), request_type="new_session", user_frequency="daily")[0] == "frequent"
    assert door.ask(fresh("daily, untyped"), user_frequency="daily")[0] == "frequent"
    assert door.ask(fresh("rare"), request_type="new_session", user_frequency="rare")[0] == "standard"
    assert door.ask(fresh("untagged"))[0] == "standard"


def fill(door) -> None:
    """Make the 3-entry cache full, its main space of answers asked three times (it stays full).
    A refresh then enters the main space beside an older entry, so the next trial's victim is
    that entry, not the refresh, even where the count-min sketch overcounts a newcomer."""
    for _ in range(2):
        hot = fresh("hot")
        for _ in range(3):
            door.ask(hot, "new_session", "weekly")
    door.ask(fresh("filler"), "new_session", "weekly")


def test_a_rare_users_repeat_is_recomputed_a_daily_users_is_a_hit(door):
    fill(door)
    daily = fresh("daily user's question")
    assert door.ask(daily, "new_session", "daily") == ("frequent", False)
    assert door.ask(daily, "new_session", "daily") == ("frequent", True)     # kept at once
    rare = fresh("rare user's question")
    assert door.ask(rare, "new_session", "rare") == ("standard", False)
    assert door.ask(rare, "new_session", "rare") == ("standard", False)      # a one-off is not kept...
    assert door.ask(rare, "new_session", "rare") == ("standard", True)       # ...but asked again, it is


def test_a_session_refresh_is_kept_in_a_full_cache_a_new_session_is_not(door):
    """The cache is full of answers asked three times; an answer asked once is kept only if its
    request is a refresh. After it, another new key (asked once) passes through the admission
    window, so what is still there was admitted to the main space."""
    fill(door)
    refresh = fresh("refresh")
    assert door.ask(refresh, "session_refresh", "weekly") == ("refresh", False)
    door.ask(fresh("pusher"), "new_session", "weekly")
    assert door.ask(refresh, "session_refresh", "weekly") == ("refresh", True)
    new = fresh("new session")
    assert door.ask(new, "new_session", "weekly") == ("standard", False)
    door.ask(fresh("pusher"), "new_session", "weekly")
    assert door.ask(new, "new_session", "weekly") == ("standard", False)
