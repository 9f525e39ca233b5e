"""Benchmarks for dynbatchd: an open-loop Poisson load generator over ZeroMQ, a goodput
search, per-request CPU accounting from /proc, and the scenarios `make bench` runs.

    python -m benchmarks.run_all            # every scenario, a few minutes on 2 cores
    python -m benchmarks.run_all --quick    # the same, shorter runs
    python -m benchmarks.loadgen --help     # one open-loop run against a running daemon
"""
