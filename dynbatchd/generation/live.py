"""Drive a `GenerationScheduler` with a real runner (`causal-lm`): the loop the daemon will run.

The clock is passed in (``time.monotonic`` live, a counter in tests), so this stays testable
without wall-clock time. Each step: evict what the plan preempted, prefill the new sequences,
decode the running ones, tell the scheduler which hit a stop, and free finished sequences' KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dynbatchd.generation.batching import Finished, GenerationScheduler, GenRequest


@dataclass(frozen=True)
class Prompt:
    id: str
    channel: str
    text: str
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    after_step: int = 0          # joins once the scheduler has run this many steps (0: at the start)


def run_live(runner: Any, scheduler: GenerationScheduler, prompts: list[Prompt],
             clock: Callable[[], float], on_token: Callable[[str, str], None] | None = None
             ) -> tuple[dict[str, str], list[Finished]]:
    """Generate every prompt, each joining at its step; returns (texts by id, ends in order)."""
    ended: list[Finished] = []
    pending = sorted(prompts, key=lambda p: p.after_step)
    texts: dict[str, str] = {}
    step = 0
    while pending or not scheduler.idle:
        while pending and pending[0].after_step <= step:
            p, now = pending.pop(0), clock()
            seq = runner.add(p.id, p.text, max_new_tokens=p.max_new_tokens, stop=list(p.stop))
            refused = scheduler.submit(GenRequest(p.id, p.channel, len(seq.prompt_ids), p.max_new_tokens, now), now)
            if refused:
                ended.append(refused)
                texts[p.id] = runner.remove(p.id).text
        plan = scheduler.plan(clock())
        for seq_id in plan.preempted:
            runner.preempt(seq_id)
        for end in plan.ended:            # expired: its KV goes now
            ended.append(end)
            texts[end.id] = runner.remove(end.id).text
        if plan.empty:
            if not pending:
                break
            step = pending[0].after_step      # nothing to run until the next one joins
            continue
        step += 1
        events = runner.prefill(plan.prefill) + runner.decode_step(plan.decode)
        for event in events:
            if on_token and event.text:
                on_token(event.seq_id, event.text)
        stopped = [e.seq_id for e in events if e.finished == "stop"]
        for end in scheduler.complete(plan, clock(), stopped):
            ended.append(end)
            texts[end.id] = runner.sequences[end.id].text
            runner.remove(end.id)
    return texts, ended
