"""Faults a live fuzzing pass found in tenancy and compliance, through the real intake, engine and
plugins (no sockets): a blank tenant is no tenant on an isolated channel (refused, or run alone,
never batched with other anonymous requests), and a regulated tag counts however it is spelt
("Banking", " banking"), in requests and in the config's checks alike."""

from __future__ import annotations

import tomllib

import pytest

from dynbatchd import protocol as P
from dynbatchd.config import ConfigError
from dynbatchd.config.reading import parse
from dynbatchd.engine import ANONYMOUS_RULE, Engine, Job, Outcome
from dynbatchd.engine.intake import ADMISSION_RULE, Intake, Refusal, RequestMeta
from dynbatchd.plugins import Plugins
from dynbatchd.scheduler import build_channels
from dynbatchd.tenancy import CLAIM_RULE, KEY_RULE, tenant_of_key
from dynbatchd.validation import validate_config

CONFIG = """
[models.sim]
runner = "simulated"
[channels.standard]
max_batch = 8
window_ms = 1
[channels.medical]
max_batch = 8
window_ms = 1
isolated = true
[channels.vault]
max_batch = 8
window_ms = 1
isolated = true
anonymous = "alone"
[routing]
default = "standard"
[[routing.rules]]
tag = "medical"
channel = "medical"
[[routing.rules]]
tag = "banking"
channel = "vault"
"""

BLANKS = ["", " ", "\t\n", "\u3000"]


@pytest.fixture(scope="module")
def setup():
    plugins = Plugins.load()
    config = parse(tomllib.loads(CONFIG), "test")
    validate_config(config, plugins)
    return config, plugins


def admit(setup, tags=(), tenant=None):
    config, plugins = setup
    return Intake.from_plugins(config, plugins).admit(RequestMeta("sim", 10, tuple(tags), tenant=tenant))


def engine_of(config) -> Engine:
    e = Engine(build_channels(config.channels), ["d0"])
    e.device_up(0, 0)
    return e


# -- 1. a blank tenant is no tenant on an isolated channel --------------------------------------------
@pytest.mark.parametrize("blank", BLANKS)
def test_a_blank_tenant_names_nobody(blank):
    from dynbatchd.tenancy import named_tenant

    assert named_tenant(blank) is None
    assert named_tenant(None) is None and named_tenant(" a ") == " a "   # a real name is kept as sent


@pytest.mark.parametrize("blank", BLANKS)
def test_a_blank_tenant_on_an_isolated_channel_is_refused_by_the_anonymous_rule(setup, blank):
    job = admit(setup, ["medical"], blank)
    assert isinstance(job, Job) and job.channel == "medical" and job.tenant is None
    answer = engine_of(setup[0]).submit(job, 0)
    assert answer is not None and answer.code == P.REFUSED and ANONYMOUS_RULE in answer.message


def test_blank_tenants_on_an_alone_channel_each_run_in_a_batch_of_one(setup):
    e = engine_of(setup[0])
    for i, blank in enumerate(["", "", " ", " "]):
        job = admit(setup, ["banking"], blank)
        job.payload = i
        assert job.channel == "vault" and e.submit(job, 0) is None
    sizes = []
    for now in range(0, 200 * 1_000_000, 1_000_000):
        dispatches, _ = e.step(now)
        for d in dispatches:
            sizes.append(len(d.batch.items))
            e.completed(d.device, d.batch.id, ok(d.batch), now)
        if len(sizes) == 4:
            break
    assert sizes == [1, 1, 1, 1]   # before the fix "" and " " each made one shared batch of two
    assert [ev.action for ev in e.take_events()] == ["ran alone"] * 4


def ok(batch) -> Outcome:
    return Outcome(1_000_000, [None] * len(batch.items))


def test_a_blank_tenant_on_an_open_channel_is_left_as_sent(setup):
    job = admit(setup, (), "")
    assert job.channel == "standard" and job.tenant == ""


def test_with_key_tenants_a_blank_claim_is_no_claim_and_a_blank_mapping_no_tenant():
    keys = {"app": "hospital-a", "odd": " "}
    assert tenant_of_key(keys, "app", "") == ("hospital-a", None)
    assert tenant_of_key(keys, "app", "hospital-b")[1][0] == CLAIM_RULE
    assert tenant_of_key(keys, "odd", None)[1][0] == KEY_RULE
    assert tenant_of_key(keys, "app", None, proven="  ")[1][0] == KEY_RULE


# -- 2. regulated tags: case and surrounding whitespace ignored ----------------------------------------
@pytest.mark.parametrize("tag", ["Banking", " banking", "BANKING\t", "Medical ", "fInAnCiAl"])
def test_a_regulated_tag_however_spelt_is_refused_on_an_open_channel(setup, tag):
    refusal = admit(setup, [tag], "bank")
    assert isinstance(refusal, Refusal), refusal
    assert refusal.code == P.REFUSED and refusal.rule == ADMISSION_RULE and refusal.channel == "standard"
    assert repr(tag) in refusal.message


def test_ordinary_tags_route_as_spelt_and_regulated_ones_exactly_spelt_still_route(setup):
    assert admit(setup, ["banking"], "bank").channel == "vault"
    assert admit(setup, ["Medical"], "h").__class__ is Refusal   # routing matches exactly: refused, not leaked
    assert admit(setup, ["Urgent"], None).channel == "standard"   # an ordinary tag: unchanged


def test_the_one_spelling_compliance_compares():
    from dynbatchd_plugins.compliance_config import tag_key

    assert tag_key("  BanKing\n") == "banking"


def config_with(extra: str, compliance: str = "") -> str:
    return CONFIG + extra + (f"\n[compliance]\n{compliance}\n" if compliance else "")


@pytest.mark.parametrize("extra, compliance, key", [
    ('[[routing.rules]]\ntag = "Banking "\nchannel = "standard"\n', "", "channels.standard.isolated"),
    ('', 'regulated_tags = ["MEDICAL"]', None),   # the medical route goes to an isolated channel: fine
    ('[[routing.rules]]\ntag = "medical"\nchannel = "standard"\n', 'regulated_tags = [" Medical"]',
     "channels.standard.isolated"),
])
def test_the_config_checks_compare_regulated_tags_alike(extra, compliance, key):
    plugins = Plugins.load()
    text = config_with(extra, compliance)
    if key is None:
        validate_config(parse(tomllib.loads(text), "test"), plugins)
        return
    with pytest.raises(ConfigError) as refused:
        validate_config(parse(tomllib.loads(text), "test"), plugins)
    assert key in str(refused.value)


def test_a_channel_carrying_banking_in_another_case_keeps_the_banking_window_limit():
    text = CONFIG.replace("[channels.vault]\nmax_batch = 8\nwindow_ms = 1",
                          '[channels.vault]\nmax_batch = 8\nwindow_ms = 500\ncarries = ["Banking"]')
    text = text.replace('tag = "banking"\nchannel = "vault"', 'tag = "other"\nchannel = "vault"')
    with pytest.raises(ConfigError) as refused:
        validate_config(parse(tomllib.loads(text), "test"), Plugins.load())
    assert "channels.vault.window_ms" in str(refused.value)
