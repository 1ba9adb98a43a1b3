"""The live path: training-thread hooks, the reporter on the agent thread, the step clock, the
profiler sampler, the outputs (Prometheus exporter and its HTTP server, JSONL timeline, OTLP), preemption
(signal) handling and fork safety."""
