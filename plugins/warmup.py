"""Warmup inputs: what the daemon observed (the default), or a usage file.

By default the inputs are those of the most active users as the daemon itself
counted them (`dynbatchd.topusers`, saved in ``[daemon] state_dir`` as
``top-users.msgpack``; the daemon saves it just before asking this plugin), so
nobody has to prepare anything.

With ``[plugins.warmup] source = "/var/lib/dynbatchd/top_users.jsonl"`` they
come from that file instead: one JSON object per line, ``{"user": "...",
"requests": N, "text": "..."}`` (a user may have several lines, one per
input), produced by whatever else knows the users.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

from dynbatchd import topusers
from dynbatchd.config import state_path
from dynbatchd.hookspecs import WarmupJob, hookimpl
from dynbatchd_plugins.warmup_config import dynbatchd_config_tables  # noqa: F401  (registers [plugins.warmup])

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


def observed_jobs(path: Path, model: str, top_users: int, retain_days: float = 30.0) -> list[WarmupJob]:
    """The inputs of `model` that the `top_users` most active users sent, one job per tenant,
    most active users first (none past `retain_days`)."""
    by_tenant: dict[str | None, WarmupJob] = {}
    for tenant, _, _, inputs in topusers.TopUsers.load(path, retain_days=retain_days).top(top_users):
        texts = [text for m, text in inputs if m == model]
        if texts:
            by_tenant.setdefault(tenant, WarmupJob(model, tenant=tenant)).inputs.extend(texts)
    return list(by_tenant.values())


@hookimpl
def dynbatchd_warmup(model: str, top_users: int, config) -> list[WarmupJob] | WarmupJob | None:
    source = config.plugins.get("warmup", {}).get("source")
    if not source:
        return observed_jobs(state_path(config.daemon, topusers.FILE_NAME), model, top_users,
                             config.top_users.retain_days)
    path = Path(source)
    if not path.is_file():
        log.warning("warmup source %s does not exist", path)
        return None
    return WarmupJob(model, top_user_inputs(path, top_users))
