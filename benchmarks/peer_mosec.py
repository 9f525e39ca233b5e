"""The peer server of `benchmarks.peer`: Mosec, serving dynbatchd's own runners over HTTP.

    PEER_MODEL=minilm PEER_MAX_BATCH=32 PEER_WAIT_MS=10 \\
        python -m benchmarks.peer_mosec --address 127.0.0.1 --port 8123 --log-level warning

One Mosec stage, one worker process, dynamic batching (`max_batch_size`, `max_wait_time`):
the worker builds the very runner dynbatchd's worker builds (`dynbatchd.devices.runners`:
`sentence-embedding` with the bundled all-MiniLM-L6-v2, `max_tokens` 64; or `simulated`,
8 ms + 0.5 ms/item, SIMULATED) and calls its `run` on each batch, as dynbatchd's serial
worker does. Threads are set the way dynbatchd's worker sets them: OMP_NUM_THREADS and
MKL_NUM_THREADS in the worker's environment before torch is imported (Mosec's `env`).

Route `POST /v1/embeddings` takes the same body the load generator sends dynbatchd
(`{"model", "input": "one text"}`) and answers OpenAI-style, plus `batch_size` (the batch the
input rode in, for the benchmark's mean batch). Bodies are encoded with msgspec's JSON, the
encoder dynbatchd's HTTP door uses (Mosec's default is `json.dumps(indent=2)`, whose pure-Python
encoder would handicap the peer; its docs say to override `serialize`/`deserialize`).
Settings come from the environment because Mosec parses the command line itself.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import msgspec
import numpy as np
from mosec import Server, Worker
from mosec.errors import ValidationError

from benchmarks.peer_limit import build_runner

ROUTE = "/v1/embeddings"


class RunnerWorker(Worker):
    """dynbatchd's runner for PEER_MODEL, loaded once per worker process; one `run` per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.model = os.environ.get("PEER_MODEL", "minilm")
        self.runner = build_runner(self.model)
        threads = None
        if "torch" in sys.modules:
            import torch
            threads = torch.get_num_threads()
        print(f"peer worker {os.getpid()}: {self.model} loaded, torch threads {threads}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)

    def deserialize(self, data: bytes) -> Any:
        try:
            body = msgspec.json.decode(data)
        except msgspec.DecodeError as exc:
            raise ValidationError(f"not JSON: {exc}") from None
        text = body.get("input") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise ValidationError('"input" must be one string')
        return text

    def serialize(self, data: Any) -> bytes:
        return msgspec.json.encode(data)

    def forward(self, data: list[str]) -> list[dict[str, Any]]:
        tokens = [len(t) // 4 + 1 for t in data]   # dynbatchd.protocol.estimate_tokens for text
        outputs = self.runner.run(data, tokens)
        n = len(data)
        return [{"object": "list", "model": self.model, "batch_size": n,
                 "data": [{"object": "embedding", "index": 0,
                           "embedding": np.asarray(o, dtype=np.float64).ravel().tolist()}]}
                for o in outputs]


def main() -> None:
    threads = os.environ.get("PEER_THREADS", "1")
    server = Server()
    server.append_worker(RunnerWorker, num=1, max_batch_size=int(os.environ.get("PEER_MAX_BATCH", "32")),
                         max_wait_time=int(os.environ.get("PEER_WAIT_MS", "10")),
                         env=[{"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}], route=ROUTE)
    server.run()


if __name__ == "__main__":
    main()
