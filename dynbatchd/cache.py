"""A bounded result cache for text inputs, filled by traffic and by warmup jobs.

The e-commerce case: during a peak, low-frequency users crowded the cache
while top users recomputed. A nightly warmup (``dynbatchctl warmup
--top-users 10000`` from a timer or cron, see systemd/README.md) precomputes
the inputs that the warmup plugins name, off-peak, so the peak serves them
from here.

The cache itself takes any hashable key and keeps any value; the daemon keys
it by (model, tenant, text), the tenant None for requests without one, so one
tenant's result never answers another tenant's request, and warmup inputs
(which carry no tenant) serve only requests without a tenant. It keeps what
`dynbatchd.devices.batches.freeze` makes of an output: (tensor descriptor,
bytes) or (plain value, None). Only text inputs are cached, and nothing from
an isolated channel.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable


class ResultCache:
    def __init__(self, entries: int):
        self.capacity = entries
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def get(self, key: Hashable) -> Any:
        entry = self._data.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._data.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: Hashable, output: Any) -> None:
        """Keep `output` (whatever the driver caches: the daemon keeps a descriptor and its
        bytes); the least recently used entry goes first."""
        self._data[key] = output
        self._data.move_to_end(key)
        while len(self._data) > self.capacity:
            self._data.popitem(last=False)
            self.evictions += 1

    def snapshot(self) -> dict[str, Any]:
        looked = self.hits + self.misses
        return {"entries": len(self._data), "capacity": self.capacity, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions, "hit_rate": self.hits / looked if looked else 0.0}
