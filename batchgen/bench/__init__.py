"""Benchmarks: ``bench-one-batch`` (one static batch through the execution chain) and ``bench`` (offline
throughput, side by side with HF transformers)."""
