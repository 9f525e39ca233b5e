"""Benchmarking and tuning: the configuration database, the test matrix, knee detection and the
tuning loop (collector, analyzer, recommender, risk assessment, canary)."""
