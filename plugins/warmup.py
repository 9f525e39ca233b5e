"""Warmup from a usage file: the top users' inputs, most active users first.

Configured as ``[plugins.warmup] source = "/var/lib/dynbatchd/top_users.jsonl"``:
one JSON object per line, ``{"user": "...", "requests": N, "text": "..."}``
(a user may have several lines, one per input). Produced by whatever knows
the users (a nightly job over the request log, say); dynbatchd itself never
logs payloads, so it cannot build this file on its own.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

from dynbatchd.hookspecs import WarmupJob, hookimpl

log = logging.getLogger(__name__)


def top_user_inputs(path: Path, top_users: int) -> list[str]:
    activity: dict[str, int] = defaultdict(int)
    inputs: dict[str, list[str]] = defaultdict(list)
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                user, text = str(row["user"]), row["text"]
            except (ValueError, KeyError, TypeError):
                log.warning("%s:%d: not a {user, text, requests} object; skipped", path, number)
                continue
            if isinstance(text, str):
                activity[user] += int(row.get("requests", 1))
                inputs[user].append(text)
    ranked = sorted(activity, key=lambda u: (-activity[u], u))[:top_users]
    return [text for user in ranked for text in inputs[user]]


@hookimpl
def dynbatchd_warmup(model: str, top_users: int, config) -> WarmupJob | None:
    source = config.plugins.get("warmup", {}).get("source")
    if not source:
        return None
    path = Path(source)
    if not path.is_file():
        log.warning("warmup source %s does not exist", path)
        return None
    return WarmupJob(model, top_user_inputs(path, top_users))
