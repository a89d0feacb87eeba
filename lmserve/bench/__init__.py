"""Benchmarks: offline throughput, latency, online serving; HF transformers and cache-less baselines."""
