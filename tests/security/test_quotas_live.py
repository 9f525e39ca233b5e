"""Per-tenant quotas on a live daemon (a subprocess, real ipc:// and HTTP sockets, a SIMULATED device):
a tenant at 10x its quota leaves another tenant's on-time share where it was, and a refusal is
``quota_exceeded`` over ZeroMQ and 429 with Retry-After over HTTP, before it takes queue room."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from conftest import free_port, start_daemon
from dynbatchd import protocol as P
from dynbatchd.client import AsyncClient, DynbatchdError, QuotaExceeded

# One simulated device of ~235 requests/s (batches of 8 in 10 + 8 x 3 ms). The steady tenant sends
# 60/s; the flooding tenant 300/s, 10x its quota of 30/s: 360/s unchecked is past the device's
# limit, so without the quota the queue would grow by ~125 a second and the steady tenant's
# requests would miss their 1 s deadline.
BODY = """
    [models.sim]
    runner = "simulated"
    options = { base_ms = 10.0, per_item_ms = 3.0 }
    [channels.standard]
    max_batch = 8
    window_ms = 2
    deadline_ms = 1000
    queue_limit = 4096
    [routing]
    default = "standard"
    [quotas.tenants.flood]
    rate = 30
    burst = 10
    [quotas.tenants.tiny]
    rate = 1
    burst = 1
    [quotas.tenants.tiny-zmq]
    rate = 0.01
    burst = 1
    [quotas.tenants.one-at-a-time]
    inflight = 1
"""
STEADY_RATE, FLOOD_RATE, SECONDS = 60, 300, 4.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    port = free_port()
    running = start_daemon(tmp_path_factory.mktemp("quotas"), BODY + f'\n[http]\nlisten = "127.0.0.1:{port}"\n')
    running.http = f"http://127.0.0.1:{port}"
    yield running
    running.stop()


async def send_at_rate(client: AsyncClient, tenant: str, rate: float, seconds: float) -> dict[str, int]:
    """Open loop: `rate` requests a second for `seconds`, each sent at its time whatever the others do;
    their answers by code."""
    codes: dict[str, int] = {}

    async def one(i: int) -> None:
        try:
            await client.infer("sim", f"input {i} of {tenant}", tenant=tenant, deadline_ms=1000, timeout=30)
            code = "ok"
        except DynbatchdError as exc:
            code = exc.code
        codes[code] = codes.get(code, 0) + 1

    loop = asyncio.get_running_loop()
    start, tasks = loop.time(), []
    for i in range(int(rate * seconds)):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)   # the load's pacing, not a wait for the daemon
        tasks.append(asyncio.ensure_future(one(i)))
    await asyncio.gather(*tasks)
    return codes


def on_time_share(codes: dict[str, int]) -> float:
    return codes.get("ok", 0) / sum(codes.values())


def test_a_tenant_at_ten_times_its_quota_leaves_another_tenants_on_time_share_unchanged(daemon):
    async def run():
        async with AsyncClient(daemon.endpoint) as steady_client, AsyncClient(daemon.endpoint) as flood_client:
            alone = await send_at_rate(steady_client, "steady", STEADY_RATE, SECONDS)
            steady, flood = await asyncio.gather(send_at_rate(steady_client, "steady", STEADY_RATE, SECONDS),
                                                 send_at_rate(flood_client, "flood", FLOOD_RATE, SECONDS))
            return alone, steady, flood

    alone, steady, flood = asyncio.run(run())
    assert abs(on_time_share(steady) - on_time_share(alone)) <= 0.01, (alone, steady, flood)
    assert on_time_share(alone) >= 0.99, alone
    # The flood was held to its quota: a burst of 10 and 30/s, the rest refused before the queue.
    assert flood.get(P.QUOTA_EXCEEDED, 0) >= FLOOD_RATE * SECONDS * 0.8, flood
    assert flood.get("ok", 0) <= 30 * SECONDS * 1.5 + 10, flood
    assert set(flood) <= {"ok", P.QUOTA_EXCEEDED}, flood
    quotas = daemon.status()["quotas"]
    assert quotas["flood"]["refused"]["rate"] == flood[P.QUOTA_EXCEEDED]
    assert quotas["steady"]["refused"] == {"rate": 0, "inflight": 0}


def http_call(daemon, tenant: str):
    request = urllib.request.Request(daemon.http + "/v1/embeddings", data=json.dumps(
        {"model": "sim", "input": "x"}).encode(), headers={"Content-Type": "application/json", "X-Tenant": tenant})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read()), reply.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def test_over_quota_is_429_with_retry_after_over_http_and_quota_exceeded_over_zeromq(daemon):
    codes = [http_call(daemon, "tiny") for _ in range(3)]
    assert codes[0][0] == 200
    status, body, headers = codes[-1]
    assert status == 429 and body["error"]["code"] == "quota_exceeded", body
    assert int(headers["Retry-After"]) >= 1 and "quota" in body["error"]["message"]

    async def zmq_refused():
        async with AsyncClient(daemon.endpoint) as client:
            await client.infer("sim", "x", tenant="tiny-zmq")
            with pytest.raises(QuotaExceeded, match="retry after"):
                await client.infer("sim", "x", tenant="tiny-zmq")
    asyncio.run(zmq_refused())


def test_an_inflight_quota_is_freed_by_each_answer(daemon):
    """One at a time: a second concurrent request is refused, and after each answer the next is admitted
    (so every answer, whatever its code, gives its place back)."""
    async def run():
        async with AsyncClient(daemon.endpoint) as client:
            first = asyncio.ensure_future(client.infer("sim", "a", tenant="one-at-a-time"))
            await asyncio.sleep(0)   # (sent before the second is)
            with pytest.raises(QuotaExceeded):
                await client.infer("sim", "b", tenant="one-at-a-time")
            await first
            for i in range(20):   # sequential: each admitted, the place freed by the answer before
                await client.infer("sim", f"c{i}", tenant="one-at-a-time")
            with pytest.raises(DynbatchdError):   # an error answer (unknown model is refused earlier;
                await client.infer("sim", "d", tenant="one-at-a-time", deadline_ms=0.001)   # deadline)
            await client.infer("sim", "e", tenant="one-at-a-time")
    asyncio.run(run())
