"""The restart budget as a circuit breaker, on a fake clock (seconds): when a dead worker is
started again, when its device is given up, and when a given-up device is probed again."""

from __future__ import annotations

from dynbatchd.devices.pool import PROBE_MAX_S, Restart, RestartBudget


def test_the_restart_budget_counts_deaths_in_a_window_so_it_and_the_back_off_reset():
    budget = RestartBudget(limit=3, window_s=600)
    assert [budget.died(t) for t in (0, 1, 2)] == [Restart(0.25, False), Restart(0.5, False), Restart(1.0, False)]
    assert budget.died(3).given_up                                    # a fourth in ten minutes: give up
    healthy = RestartBudget(limit=3, window_s=600)
    for hour in range(10):                    # six-plus deaths, each after long healthy service
        assert healthy.died(hour * 3600.0) == Restart(0.25, False)


def test_a_proven_poison_refunds_the_death_that_proved_it():
    budget = RestartBudget(limit=1, window_s=600)
    for poison in range(3):                   # three poison inputs, each killing its worker twice
        assert budget.died(poison * 10.0) == Restart(0.25, False)
        assert budget.died(poison * 10.0 + 1, explained=True) == Restart(0.0, False)
    assert len(budget.deaths) == 0


def test_a_given_up_device_is_probed_after_a_cool_down_that_doubles_while_probes_die():
    """Six deaths 20 s apart used to give the device up for good. Now each give-up says when to
    probe it (start its worker again); a probe that dies soon doubles the wait, up to the cap."""
    budget = RestartBudget(limit=5, window_s=600, probe_s=30)
    now = 0.0
    for _ in range(5):
        assert not budget.died(now).given_up
        now += 20
    assert budget.died(now) == Restart(30, True)          # the sixth: given up, probed in 30 s
    waits = []
    for _ in range(8):                                     # each probe dies a second after it came up
        now += waits[-1] if waits else 30
        now += 1
        restart = budget.died(now)
        assert restart.given_up
        waits.append(restart.delay_s)
    assert waits == [60, 120, 240, 480, PROBE_MAX_S, PROBE_MAX_S, PROBE_MAX_S, PROBE_MAX_S]


def test_a_probe_that_stays_up_closes_the_breaker_and_the_cool_down_starts_over():
    budget = RestartBudget(limit=1, window_s=600, probe_s=30)
    assert not budget.died(0).given_up
    assert budget.died(1) == Restart(30, True)
    assert budget.died(40) == Restart(60, True)            # the first probe died at once
    # the second probe (at 100 s) serves; its worker dies an hour later: an ordinary restart
    assert budget.died(3700) == Restart(0.25, False)
    assert budget.died(3701) == Restart(30, True)           # given up again: the wait starts over


def test_with_no_restarts_allowed_every_death_gives_up_but_the_wait_resets_after_healthy_service():
    budget = RestartBudget(limit=0, window_s=600, probe_s=2)
    assert budget.died(0) == Restart(2, True)
    assert budget.died(3) == Restart(4, True)               # the probe died soon after it came up
    assert budget.died(10_000) == Restart(2, True)          # hours later: back to the first wait


def test_a_long_first_cool_down_is_its_own_cap():
    budget = RestartBudget(limit=0, window_s=600, probe_s=1000)
    assert [budget.died(t).delay_s for t in (0, 1, 2)] == [1000, 1000, 1000]
