"""The continuous-batching scheduler and its simulator, on a fake clock (no model, no sockets)."""

from __future__ import annotations

import pytest

from dynbatchd.generation.batching import ChannelTargets, GenerationScheduler, GenRequest
from dynbatchd.generation.kv import KVLedger, kv_budget_bytes, kv_bytes_per_token
from dynbatchd.generation.simulation import k12_workload, mixed_workload, simulate_generation
from dynbatchd.memory import model_dims, per_request_bytes

CHANNELS = {"realtime": ChannelTargets("realtime", priority=0, ttft_ms=500, tpot_ms=50),
            "bulk": ChannelTargets("bulk", priority=2, ttft_ms=60_000, tpot_ms=500)}


def scheduler(budget_tokens: int, mode: str = "continuous", **kw) -> GenerationScheduler:
    return GenerationScheduler(KVLedger(budget_tokens, 1), CHANNELS, mode=mode, **kw)


def run_steps(sched: GenerationScheduler, now: float, n: int = 1, step_ms: float = 10.0):
    """`n` steps on the fake clock; returns (now, plans, ends)."""
    plans, ends = [], []
    for _ in range(n):
        plan = sched.plan(now)
        plans.append(plan)
        ends.extend(plan.ended)
        now += step_ms
        ends.extend(sched.complete(plan, now))
    return now, plans, ends


def test_kv_per_token_is_the_planners_formula():
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
           "max_position_embeddings": 4096, "torch_dtype": "float16", "architectures": ["LlamaForCausalLM"]}
    dims = model_dims(cfg)
    assert kv_bytes_per_token(dims) == 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token(dims) * 4096 == per_request_bytes(dims)[0]
    budget = kv_budget_bytes(dims, 80 << 30)
    assert budget < 80 * (1 << 30) * 0.8 - dims.weights_bytes + 1      # headroom and weights come off


def test_requests_join_and_leave_at_token_boundaries():
    sched = scheduler(10_000)
    sched.submit(GenRequest("a", "bulk", 10, 3), 0.0)
    now, plans, _ = run_steps(sched, 0.0, 1)
    assert plans[0].prefill == ("a",)
    sched.submit(GenRequest("b", "bulk", 5, 5), now)          # joins the running batch next step
    now, plans, ends = run_steps(sched, now, 2)
    assert plans[0].prefill == ("b",) and plans[0].decode == ("a",)
    assert [e.id for e in ends] == ["a"] and ends[0].reason == "length" and ends[0].output_tokens == 3
    assert plans[1].decode == ("a", "b")
    _, plans, _ = run_steps(sched, now, 1)
    assert plans[0].decode == ("b",)                           # a left; b goes on alone


def test_admission_waits_until_the_worst_case_fits_and_never_exceeds_the_budget():
    sched = scheduler(100)
    sched.submit(GenRequest("a", "bulk", 40, 20), 0.0)        # worst case 60
    sched.submit(GenRequest("b", "bulk", 30, 20), 0.0)        # 50: does not fit beside a
    now, plans, _ = run_steps(sched, 0.0, 1)
    assert plans[0].prefill == ("a",) and "b" in sched.waiting
    assert sched.ledger.in_use_bytes == 60 and sched.ledger.refused >= 1
    now, _, ends = run_steps(sched, now, 19)
    assert [e.id for e in ends] == ["a"]
    now, plans, _ = run_steps(sched, now, 1)
    assert plans[0].prefill == ("b",)
    assert sched.ledger.peak_bytes <= 100 and sched.ledger.over_budget == 0


def test_a_request_that_could_never_fit_is_refused_at_once():
    sched = scheduler(100)
    end = sched.submit(GenRequest("huge", "bulk", 90, 20), 0.0)
    assert end.reason == "too_large" and sched.idle


def test_higher_class_preempts_lower_by_recompute():
    sched = scheduler(100)
    sched.submit(GenRequest("low", "bulk", 50, 40), 0.0)
    now, _, _ = run_steps(sched, 0.0, 5)
    sched.submit(GenRequest("rt", "realtime", 20, 10), now)   # 30 more: does not fit beside 90
    now, plans, _ = run_steps(sched, now, 1)
    assert plans[0].preempted == ("low",) and plans[0].prefill == ("rt",)
    assert "low" in sched.waiting and sched.ledger.reserved == {"rt": 30}
    now, _, ends = run_steps(sched, now, 9)
    assert [e.id for e in ends] == ["rt"]
    now, plans, _ = run_steps(sched, now, 1)
    assert plans[0].prefill == ("low",) and plans[0].prefill_lengths == (55,)   # prompt + 5 tokens it had
    now, _, ends = run_steps(sched, now, 40)
    low = next(e for e in ends if e.id == "low")
    assert low.output_tokens == 40 and low.preemptions == 1


def test_lower_class_never_preempts_higher():
    sched = scheduler(100)
    sched.submit(GenRequest("rt", "realtime", 50, 40), 0.0)
    now, _, _ = run_steps(sched, 0.0, 1)
    sched.submit(GenRequest("low", "bulk", 20, 20), now)
    now, plans, _ = run_steps(sched, now, 1)
    assert not plans[0].preempted and "low" in sched.waiting


def test_priority_then_deadline_orders_admission():
    sched = scheduler(1000, max_batch=1)
    sched.submit(GenRequest("bulk", "bulk", 5, 1, 0.0), 0.0)
    sched.submit(GenRequest("late", "realtime", 5, 1, 0.0, deadline_ms=900.0), 0.0)
    sched.submit(GenRequest("soon", "realtime", 5, 1, 1.0, deadline_ms=100.0), 1.0)
    _, plans, _ = run_steps(sched, 1.0, 3)
    assert [p.prefill for p in plans] == [("soon",), ("late",), ("bulk",)]


def test_within_a_class_the_first_token_due_soonest_goes_first():
    channels = {"chat": ChannelTargets("chat", priority=1, ttft_ms=100),
                "report": ChannelTargets("report", priority=1, ttft_ms=10_000)}
    sched = GenerationScheduler(KVLedger(1000, 1), channels, max_batch=1)
    sched.submit(GenRequest("report", "report", 5, 1, 0.0), 0.0)     # arrived first, due at 10 s
    sched.submit(GenRequest("chat", "chat", 5, 1, 50.0), 50.0)        # due at 150 ms
    _, plans, _ = run_steps(sched, 50.0, 2)
    assert [p.prefill for p in plans] == [("chat",), ("report",)]


def test_cancel_frees_kv_at_once():
    sched = scheduler(100)
    sched.submit(GenRequest("a", "bulk", 40, 40), 0.0)
    now, _, _ = run_steps(sched, 0.0, 3)
    assert sched.ledger.in_use_bytes == 80
    end = sched.cancel("a", now)
    assert end.reason == "cancelled" and end.output_tokens == 3 and sched.ledger.in_use_bytes == 0


def test_deadline_ends_a_waiting_or_running_request_and_frees_its_kv():
    sched = scheduler(100)
    sched.submit(GenRequest("a", "bulk", 40, 40, 0.0, deadline_ms=25.0), 0.0)   # waits: no room
    sched.submit(GenRequest("b", "bulk", 40, 40, 0.0, deadline_ms=15.0), 0.0)   # earlier deadline: runs
    now, plans, ends = run_steps(sched, 0.0, 4)
    assert plans[0].prefill == ("b",) and plans[2].prefill == ("a",)
    assert [(e.id, e.reason) for e in ends] == [("b", "deadline_exceeded"), ("a", "deadline_exceeded")]
    assert sched.idle and sched.ledger.in_use_bytes == 0


def test_prefill_per_step_is_capped_but_one_long_prompt_runs_alone():
    sched = scheduler(100_000, max_prefill_tokens=100)
    for i, n in enumerate((60, 60, 500)):
        sched.submit(GenRequest(f"r{i}", "bulk", n, 2, float(i)), float(i))
    _, plans, _ = run_steps(sched, 2.0, 3)
    assert [p.prefill for p in plans] == [("r0",), ("r1",), ("r2",)]


def test_a_lower_class_prefill_waits_while_it_would_break_a_higher_class_tpot():
    cost = lambda prefill, decoding: 10.0 + 0.05 * prefill           # noqa: E731
    sched = scheduler(100_000, step_cost_ms=cost)
    sched.submit(GenRequest("rt", "realtime", 10, 4), 0.0)          # realtime TPOT target 50 ms
    now, _, _ = run_steps(sched, 0.0, 1)
    sched.submit(GenRequest("big", "bulk", 1000, 2), now)           # 60 ms step: would break it
    sched.submit(GenRequest("rt2", "realtime", 100, 2), now)        # same class: 15 ms, fine
    now, plans, _ = run_steps(sched, now, 1)
    assert plans[0].prefill == ("rt2",) and "big" in sched.waiting and sched.held_for_tpot >= 1
    now, plans, ends = run_steps(sched, now, 3)
    assert {e.id for e in ends} == {"rt", "rt2"}
    assert ("big",) in [p.prefill for p in plans]                  # once no realtime token waits on it


def test_static_mode_admits_no_joins_and_holds_the_batch_to_its_longest_member():
    sched = scheduler(10_000, mode="static")
    sched.submit(GenRequest("short", "bulk", 5, 2), 0.0)
    sched.submit(GenRequest("long", "bulk", 5, 6), 0.0)
    now, plans, _ = run_steps(sched, 0.0, 1)
    sched.submit(GenRequest("late", "bulk", 5, 1), now)
    now, plans, ends = run_steps(sched, now, 5)
    assert all(not p.prefill for p in plans)                  # late never joined
    assert plans[-1].held == 1 and sched.ledger.in_use_bytes == 0   # freed only when long ended
    _, plans, _ = run_steps(sched, now, 1)
    assert plans[0].prefill == ("late",)


def test_a_static_batch_whose_last_live_member_expires_is_freed():
    """Its ended members held the batch for good: no waiting request was admitted again."""
    sched = scheduler(10_000, mode="static")
    sched.submit(GenRequest("short", "bulk", 5, 1), 0.0)
    sched.submit(GenRequest("long", "bulk", 5, 100, deadline_ms=35.0), 0.0)
    now, _, ends = run_steps(sched, 0.0, 2)
    assert [e.id for e in ends] == ["short"]
    sched.submit(GenRequest("next", "bulk", 5, 1), now)
    now, plans, ends = run_steps(sched, now, 3)   # (long expires at the third: 40 ms past its 35)
    assert ("next", "length") in [(e.id, e.reason) for e in ends], ends
    assert sched.idle and sched.ledger.in_use_bytes == 0


def test_simulated_continuous_is_at_least_twice_static_within_targets():
    channels = {"standard": ChannelTargets("standard", ttft_ms=2000, tpot_ms=100)}
    reqs = mixed_workload(200, rate_per_s=8, seed=3)
    cont = simulate_generation(reqs, channels, mode="continuous", kv_budget_tokens=150_000)
    static = simulate_generation(reqs, channels, mode="static", kv_budget_tokens=150_000)
    assert len(cont.finished) == len(static.finished) == 200
    assert cont.goodput_tokens_per_s >= 2 * static.goodput_tokens_per_s
    assert cont.kv["kv_over_budget"] == static.kv["kv_over_budget"] == 0


def test_k12_grading_waits_for_room_and_never_breaks_the_budget():
    channels = {"chat": ChannelTargets("chat", priority=0, ttft_ms=1000, tpot_ms=100),
                "grading": ChannelTargets("grading", priority=2, ttft_ms=120_000, tpot_ms=500)}
    reqs = k12_workload(300, rate_per_s=10, seed=1)
    report = simulate_generation(reqs, channels, mode="continuous", kv_budget_tokens=40_000)
    assert len(report.finished) == 300 and all(f.reason == "length" for f in report.finished)
    assert report.kv["kv_peak_bytes"] <= 40_000 and report.kv["kv_over_budget"] == 0
    chat = [f for f in report.finished if f.channel == "chat"]
    assert sum(report.met(f) for f in chat) >= 0.9 * len(chat)
    guarded = simulate_generation(reqs, channels, mode="continuous", kv_budget_tokens=40_000, tpot_guard=True)
    assert guarded.kv["kv_over_budget"] == 0 and len(guarded.finished) == 300
    assert sum(guarded.met(f) for f in guarded.finished if f.channel == "chat") >= sum(report.met(f) for f in chat)


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="mode"):
        scheduler(10, mode="paged")
