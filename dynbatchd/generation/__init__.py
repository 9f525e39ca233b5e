"""Generative models: iteration-level (continuous) batching with the KV cache as the admission budget.

Pure logic, like `dynbatchd.scheduler`: no clock, no sockets. `kv` turns the memory planner's KV
formula into a live ledger; `batching` decides, at each token boundary, which sequences prefill,
which decode and which wait or are preempted; `simulation` drives it with a latency model and a
fake clock. The runner that does the real work is `dynbatchd.devices.causal_lm`.
"""
