"""The local device pool hands results over as it reads them and says when a read is done, so the
daemon runs one scheduling pass for all the results read at once, right then."""

from __future__ import annotations

import zmq

from dynbatchd import protocol as P
from dynbatchd.devices.pool import DevicePool


def test_the_results_read_at_once_are_followed_by_one_read_done(tmp_path):
    events: list[object] = []
    pool = DevicePool(zmq.Context.instance(), ["cpu", "cpu"], [], cpu_threads=0, ipc_dir=str(tmp_path),
                      restart_limit=1, on_result=lambda device, result, frames: events.append((device, result.batch_id)),
                      on_lost=lambda device: False, on_ready=lambda device: None, on_gone=lambda device: None,
                      on_read_done=lambda: events.append("read done"))
    try:
        names = [w.name.encode() for w in pool.workers]
        pool._on_messages([[names[0], P.encoder.encode(P.BatchResult(7, 1000, values=[1]))],
                           [names[1], P.encoder.encode(P.BatchResult(8, 1000, values=[2]))],
                           [b"nobody", P.encoder.encode(P.BatchResult(9, 1000, values=[3]))]])
        assert events == [(0, 7), (1, 8), "read done"]
    finally:
        pool.io.sock.close(0)
