"""The live path: training-thread hooks, the reporter on the agent thread, the step clock, the
profiler sampler, and the outputs (Prometheus exporter, JSONL timeline, OTLP)."""
