"""The restart budget of a device's worker (a circuit breaker), shared by the local pool
(`dynbatchd.devices.pool`) and the Ray pool (`dynbatchd.devices.ray_pool`): in a module of its own
so that neither pool imports the other."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

RESTART_WINDOW_S = 600.0     # deaths older than this no longer count against the budget
MAX_BACKOFF_S = 30.0
PROBE_MAX_S = 600.0          # the longest cool-down between probes of a given-up device


class Restart(NamedTuple):
    delay_s: float       # wait this long, then start the worker again
    given_up: bool       # the device is out of service meanwhile (the worker started then is a probe)


class RestartBudget:
    """When to start a dead worker again, and whether its device is given up meanwhile: a
    circuit breaker, pure logic on the caller's clock (seconds).

    Closed: a death restarts the worker after a back-off (0.25 s, doubling, at most 30 s) that
    follows the deaths of the last `window_s`. More than `limit` of them open it: the device is
    given up and, after a cool-down (`probe_s`), probed: its worker is started again, and serves
    once it is up. The device stays on probation until that worker has lived `window_s`: a death
    meanwhile gives it up again and doubles the cool-down (at most PROBE_MAX_S, or `probe_s`
    when longer); after it the breaker is closed and the next give-up waits `probe_s` again. So
    a device that recovers comes back on its own, and one that does not is tried ever more
    rarely. An explained death (a proven poison input) refunds the death that proved it and
    costs nothing.
    """

    def __init__(self, limit: int, window_s: float = RESTART_WINDOW_S, probe_s: float = 30.0):
        self.limit = limit
        self.window_s = window_s
        self.probe_s = probe_s
        self.cooldown_s = 0.0       # the last cool-down while on probation; 0: closed
        self.probed_s = 0.0         # when the last probe started
        self.deaths: deque[float] = deque()

    def died(self, now_s: float, explained: bool = False) -> Restart:
        deaths = self.deaths
        while deaths and now_s - deaths[0] > self.window_s:
            deaths.popleft()
        if explained:
            if deaths:
                deaths.pop()
            return Restart(0.0, False)
        if self.cooldown_s and now_s - self.probed_s >= self.window_s:
            self.cooldown_s = 0.0   # the probe served a whole window: closed again
        deaths.append(now_s)
        if not self.cooldown_s and len(deaths) <= self.limit:
            return Restart(min(MAX_BACKOFF_S, 0.25 * 2 ** (len(deaths) - 1)), False)
        cap = max(self.probe_s, PROBE_MAX_S)
        self.cooldown_s = min(cap, self.cooldown_s * 2) if self.cooldown_s else self.probe_s
        self.probed_s = now_s + self.cooldown_s
        return Restart(self.cooldown_s, True)
