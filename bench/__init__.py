"""Benchmarks: what the gateway and its memory recall add to a chat turn.

``python -m bench`` starts every part on loopback in its own process (a zero-latency
OpenAI-compatible upstream, the embedded memory store preloaded with a generated corpus, the
gateway, optionally the LiteLLM proxy as a peer), drives each configuration with the load
generator in :mod:`bench.loadgen`, and prints one table of latencies, throughput and ratios to
the direct call (machines are noisy: the ratios measured side by side are the result).
"""
