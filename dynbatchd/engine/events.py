"""What the engine decided beside its answers, for the driver to carry out after the call returns.

The engine never calls back into I/O or config: an isolation decision (which the daemon writes to
its audit trail, reading the wall clock) and a canary's verdict (which the daemon applies as a
config change, rebuilding channels) are appended to the engine's outbox instead. The driver drains
it with `Engine.take_events()` after each engine call, so nothing outside the engine runs while
the engine is part-way through a batch, and a simulator that keeps no audit trail just drops them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from dynbatchd.engine.records import Job, Split


@dataclass(slots=True, frozen=True)
class AuditEvent:
    """An isolation rule decided about `job`: `action` is "refused" (answered refused) or "ran alone"."""
    rule: str
    action: str
    job: Job


@dataclass(slots=True, frozen=True)
class VerdictEvent:
    """A canary's split ended (the judge decided, or an operator stopped it); its verdict is on `split`."""
    split: Split


EngineEvent = Union[AuditEvent, VerdictEvent]
