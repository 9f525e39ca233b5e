"""The sans-I/O engine that both the daemon and the simulator drive (see `core`).

A package split by job (issue 25); this module re-exports every name the rest
of the code base imports from `dynbatchd.engine`, so those imports keep working
as the pieces move between modules.
"""

from dynbatchd.engine.core import Engine
from dynbatchd.engine.events import AuditEvent, EngineEvent, VerdictEvent
from dynbatchd.engine.records import (
    ANONYMOUS_RULE,
    LATENCY_PERIOD_NS,
    MAX_RETRIES,
    OK,
    QUARANTINE_SIZE,
    SUSPECT_FACTOR,
    SUSPECT_FLOOR_NS,
    WARMUP_DEADLINE_NS,
    Answer,
    Device,
    Dispatch,
    Job,
    Loss,
    Outcome,
    Split,
)

__all__ = [
    "ANONYMOUS_RULE", "LATENCY_PERIOD_NS", "MAX_RETRIES", "OK", "QUARANTINE_SIZE", "SUSPECT_FACTOR",
    "SUSPECT_FLOOR_NS", "WARMUP_DEADLINE_NS", "Answer", "Device", "Dispatch", "Engine", "Job", "Loss",
    "Outcome", "Split", "AuditEvent", "EngineEvent", "VerdictEvent",
]
