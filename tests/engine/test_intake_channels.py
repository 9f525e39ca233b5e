"""An HTTP API key bound to channels is checked by the intake, against the one channel its routing
picks (the door no longer routes a request a second time to check it): refused before tenancy,
the admission hooks and the quota see it."""

from __future__ import annotations

from dynbatchd import protocol as P
from dynbatchd.config import ChannelSettings
from dynbatchd.engine import Job
from dynbatchd.engine.intake import Intake, Refusal, RequestMeta, sim_config

CHANNELS = {name: ChannelSettings(max_batch=4, window_ms=0, deadline_ms=100) for name in ("standard", "vault")}


def intake(asked: list) -> Intake:
    """Routing (banking to the vault), an admission hook and a quota that record being asked."""
    def route(info, config):
        asked.append("route")
        return "vault" if "banking" in info.tags else "standard"

    return Intake(sim_config(CHANNELS), route, admit_check=lambda info, channel, config: asked.append("admit"),
                  quota=lambda tenant, payload: asked.append("quota"))


def test_a_key_may_send_only_where_routing_puts_it_within_its_channels():
    asked: list = []
    refused = intake(asked).admit(RequestMeta("m", tags=("banking",), allowed_channels=("standard",)))
    assert refused == Refusal(P.REFUSED, "this API key may not send to channel 'vault'", None, "vault", None)
    assert asked == ["route"]   # routed once; no admission hook, no quota for it
    asked.clear()
    job = intake(asked).admit(RequestMeta("m", allowed_channels=("standard",)))
    assert isinstance(job, Job) and job.channel == "standard" and asked == ["route", "admit", "quota"]


def test_no_channels_named_means_anywhere():
    asked: list = []
    job = intake(asked).admit(RequestMeta("m", tags=("banking",)))
    assert isinstance(job, Job) and job.channel == "vault"
