"""One front door: the daemon's intake path and the simulator decide the same requests alike
(unknown model, a compliance refusal, an isolated channel without a tenant, a cached repeat,
tag routing, a client's deadline and a defaulted one), with the real plugins loaded."""

from __future__ import annotations

import tomllib
from types import SimpleNamespace

import msgspec
import pytest

from dynbatchd import protocol as P
from dynbatchd.cache import ResultCache
from dynbatchd.config.reading import parse
from dynbatchd.daemon_batches import Pending
from dynbatchd.engine import OK, Job
from dynbatchd.engine.intake import Intake, Refusal, RequestMeta
from dynbatchd.plugins import Plugins
from dynbatchd.simulate.driver import simulate
from dynbatchd.simulate.traces import Arrival

CONFIG = """
[models.sim]
runner = "simulated"
[channels.standard]
max_batch = 8
window_ms = 1
deadline_ms = 500
[channels.urgent]
max_batch = 8
window_ms = 1
deadline_ms = 50
[channels.medical]
max_batch = 8
window_ms = 1
isolated = true
[routing]
default = "standard"
[[routing.rules]]
tag = "urgent"
channel = "urgent"
[[routing.rules]]
tag = "medical"
channel = "medical"
[cache]
entries = 100
"""

# (tags, model, tenant, text, deadline_ms) per request, 1 ms apart
REQUESTS = [
    ((), "nope", None, None, None),                  # unknown model
    (("financial",), "sim", "bank", None, None),     # regulated, routed to an open channel: refused
    (("medical",), "sim", None, None, None),         # isolated channel, no tenant: refused by the engine
    (("medical",), "sim", "hospital-a", None, None),  # isolated, with a tenant: runs
    ((), "sim", None, "hello", None),                # cached later ...
    ((), "sim", None, "hello", None),                # ... the repeat
    (("urgent",), "sim", None, None, None),          # tag routing, defaulted deadline
    ((), "sim", None, None, 123.0),                  # the client's deadline
]


@pytest.fixture(scope="module")
def setup():
    return parse(tomllib.loads(CONFIG)), Plugins.load()


def meta(tags, model, tenant, text, deadline_ms) -> RequestMeta:
    return RequestMeta(model, 10, tags, tenant=tenant, text=text, deadline_ms=deadline_ms)


def daemon_answers(config, plugins) -> tuple[dict[int, str], dict[int, Job]]:
    """REQUESTS through a real, in-process Daemon's on_request (as the HTTP door calls it, with a
    LocalEnvelope): the codes answered at once, and the Jobs it queued."""
    from dynbatchd.doors import LocalEnvelope
    from dynbatchd.service import Daemon

    daemon = Daemon(config, plugins)
    daemon.state, daemon.front = "serving", SimpleNamespace(curve=False, peer=None)
    daemon._schedule_pump = lambda: None   # no loop here: what was queued is all we look at
    answered: dict[int, str] = {}
    for i, (tags, model, tenant, text, deadline_ms) in enumerate(REQUESTS):
        envelope = LocalEnvelope([b"client-%d" % i])
        envelope.tenant = None
        envelope.future = SimpleNamespace(done=lambda: False, set_result=lambda a, i=i: answered.__setitem__(i, a.code))
        daemon.on_request(envelope, P.Request(i, model, text=text, tags=list(tags), tenant=tenant,
                                              deadline_ms=deadline_ms), [])
    return answered, {request_id: job for (_, request_id), job in daemon._queued.items()}


def test_the_daemon_and_the_simulator_answer_alike(setup, tmp_path):
    config, plugins = setup
    config = msgspec.structs.replace(config, daemon=msgspec.structs.replace(config.daemon, state_dir=str(tmp_path)))
    answered, queued = daemon_answers(config, plugins)
    codes: list[str] = []
    arrivals = [Arrival(i * 1_000_000, P.estimate_tokens(P.Request(i, model, text=text)), None, tags, tenant,
                        model, deadline_ms, text=text)
                for i, (tags, model, tenant, text, deadline_ms) in enumerate(REQUESTS)]
    result = simulate(config.channels, arrivals, config=config, plugins=plugins,
                      cache=ResultCache(100, 1 << 20), codes=codes)
    assert answered == {0: P.UNKNOWN_MODEL, 1: P.REFUSED, 2: P.REFUSED}   # model, compliance, anonymous rule
    assert sorted(answered) + sorted(queued) == list(range(len(REQUESTS)))
    for i, code in answered.items():
        assert codes[i] == code
    for i, job in queued.items():
        assert codes[i] == OK
        assert result.channel_of[i] == job.channel
        assert result.slo_ns[i] == int(job.deadline_ms * 1_000_000)
    assert [queued[i].channel for i in range(3, 8)] == ["medical", "standard", "standard", "urgent", "standard"]
    assert [queued[i].deadline_ms for i in (6, 7)] == [50, 123.0]
    assert queued[4].cache_key == queued[5].cache_key == ("sim", None, "hello")


def test_a_quota_refusal_comes_after_routing_and_compliance(setup):
    config, plugins = setup
    intake = Intake.from_plugins(config, plugins, quota=lambda tenant, payload: "over quota")
    assert intake.admit(meta(("financial",), "sim", "bank", None, None)).rule == "admission-check"
    refusal = intake.admit(meta((), "sim", "bank", None, None))
    assert (refusal.code, refusal.rule, refusal.channel) == (P.QUOTA_EXCEEDED, None, "standard")


def test_the_quota_is_not_asked_while_the_config_sets_none_and_is_after_a_reload_that_sets_one(setup):
    config, plugins = setup
    asked = []
    configs_with_quota = set()

    def quota(tenant, payload):
        asked.append(tenant)
        return None

    intake = Intake.from_plugins(config, plugins, quota=quota, quota_on=lambda c: id(c) in configs_with_quota)
    assert isinstance(intake.admit(meta((), "sim", "bank", None, None)), Job)
    assert asked == []                      # no quota configured: no call a request
    reloaded = msgspec.structs.replace(config)
    configs_with_quota.add(id(reloaded))
    intake.config = reloaded                # the reload's config sets one: asked from the next request
    assert isinstance(intake.admit(meta((), "sim", "bank", None, None)), Job)
    assert asked == ["bank"]


CAPPED = """
[models.minilm]
runner = "sentence-embedding"
options = { max_tokens = 128 }
[models.sim]
runner = "simulated"
[channels.standard]
max_batch = 8
window_ms = 1
[channels.bulk]
max_batch = 8
window_ms = 1
deadline_ms = 30000
[routing]
default = "standard"
[[routing.rules]]
tokens_above = 8192
channel = "bulk"
"""


def test_a_job_counts_no_more_tokens_than_its_model_reads_while_routing_sees_the_request():
    # A 40 KB text is ~10k tokens by its size; MiniLM reads its first max_tokens. Counted in full,
    # its learned cost on a CPU (0.14-0.18 ms a token) said 1.4 s, and a 1 s channel refused it,
    # as deadline_exceeded, for a request that runs in 80 ms.
    intake = Intake.from_plugins(parse(tomllib.loads(CAPPED)), Plugins.load())
    long = intake.admit(RequestMeta("minilm", 10_000))
    assert (long.channel, long.tokens) == ("bulk", 128)          # routed by its size, costed by what is read
    assert intake.admit(RequestMeta("minilm", 100)).tokens == 100
    assert intake.admit(RequestMeta("sim", 10_000)).tokens == 10_000   # a runner with no cap: every token counts
    intake.config = parse(tomllib.loads(CAPPED.replace("max_tokens = 128", "max_tokens = 512")))
    assert intake.admit(RequestMeta("minilm", 10_000)).tokens == 512   # a reload's cap, from the next request
